"""The FP8 linear's three matrix products on CUDA, and the tile configs the Triton ones can take.

- `scaled_mm`: `torch._scaled_mm` on e4m3 activations (one scale per token) and e4m3 weights
  (one per channel) with fast accumulation. Without `use_fast_accum` the rowwise product is
  slower than bf16 at every M (pytorch #147971); with it, it is 1.7-1.8x faster than bf16 at
  M = 2048 on an H200. It needs the activation quantized first (triton_quant.py).
- `w8a16`: Triton kernels for few tokens. A decode step reads every weight once for a handful
  of rows, so the product is bound by the weight bytes: the activation stays in bf16 (no quant
  at all) and each e4m3 (or int8) weight tile is widened in registers, so it reads half of
  bf16's bytes. M = 1 has a GEMV form (`tl.sum` over the K tile: no 16-row tensor-core tile
  padded with zeros); larger M a `tl.dot` form. Both write the output in one kernel: no zeroed
  buffer, no atomics, no cast afterwards. Where a small output gives too few programs to keep
  the memory busy, SPLIT_K > 1 writes float32 partials to a [SPLIT_K, M, N] workspace (every
  element written, so it needs no memset) that one small kernel sums: two kernels, not three.

- `w8a8`: a Triton GEMM of e4m3 activations by e4m3 weights on the tensor cores' FP8 rate,
  both scales applied once to the float32 accumulator. For 16-256 tokens `scaled_mm` spends
  ~15 us even on a 4096x4096 weight whose bytes take 6 at the copy rate; on the H200 this kernel
  takes 11.5-12 us there at 16-64 tokens (down: 26-28 against 41). Its weight operand is read
  K-major ([N, K] rows, K contiguous), the layout Hopper's FP8 products take without a transpose.

Which runs, and with which config, is measured on the GPU at start (fp8_tuning.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from workers.layers.fp8 import QuantizedActivation
from workers.layers.triton_import import is_available, tl, triton  # noqa: F401 - is_available is this module's API too

# torch._scaled_mm on CUDA wants both matrix dimensions it reads from the weight in multiples
# of 16; smaller or odd layers (tiny test models) multiply a dequantized weight instead.
SCALED_MM_ALIGNMENT = 16


def is_aligned(weight: torch.Tensor) -> bool:
    """Whether scaled_mm (and so the measured choice) serves this [N, K] weight."""
    return not (weight.shape[0] % SCALED_MM_ALIGNMENT or weight.shape[1] % SCALED_MM_ALIGNMENT)


class W8A16Config(NamedTuple):
    """One launch shape of the small-M kernel. gemv: the M = 1 form (tl.sum, not tl.dot)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    gemv: bool = False

    def label(self) -> str:
        form = "gemv" if self.gemv else "dot"
        return (f"{form} n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages} "
                f"split{self.split_k}")


def block_m_for(m: int) -> int:
    return 16 if m <= 16 else (32 if m <= 32 else 64)  # tl.dot's smallest M is 16


# The configs timed at start, per token count. Small BLOCK_N gives N >= 4096 enough programs
# (4096 / 16 = 256 on 132 SMs) without split-K; split-K stays for the configs that need wide tiles.
# M = 1 also tries longer K runs and more programs (narrow tiles, split-K): at 45-73% of the
# bandwidth with the first eight, the small shapes (qkv, o) were short of bytes in flight per SM.
GEMV_CONFIGS = tuple(W8A16Config(n, k, w, st, sp, gemv=True) for n, k, w, st, sp in (
    (8, 512, 4, 3, 1), (16, 512, 4, 3, 1), (32, 256, 4, 3, 1), (16, 1024, 8, 2, 1), (32, 512, 8, 2, 1),
    (16, 512, 4, 1, 1), (16, 512, 4, 3, 2), (64, 256, 8, 2, 2),
    (8, 1024, 4, 2, 1), (4, 2048, 4, 2, 1), (8, 2048, 8, 2, 1), (8, 1024, 4, 3, 2), (16, 512, 4, 3, 4),
    (4, 1024, 4, 3, 2)))
DOT_CONFIGS_M16 = tuple(W8A16Config(*c) for c in (
    (16, 256, 4, 4), (32, 256, 4, 4), (32, 128, 4, 5), (64, 128, 4, 4), (16, 512, 4, 3), (64, 256, 8, 3),
    (64, 128, 4, 4, 2), (128, 128, 8, 3, 2)))
DOT_CONFIGS_M64 = tuple(W8A16Config(*c) for c in (
    (32, 128, 4, 4), (64, 128, 4, 4), (64, 64, 4, 5), (128, 64, 8, 4), (64, 128, 4, 4, 2)))
DOT_CONFIGS_LARGE = tuple(W8A16Config(*c) for c in (
    (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 4), (128, 128, 8, 3)))


class W8A8Config(NamedTuple):
    """One launch shape of the FP8 x FP8 kernel (BLOCK_M >= 64: one warpgroup's product)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1

    def label(self) -> str:
        return (f"m{self.block_m} n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages} "
                f"split{self.split_k}")


# Timed from W8A8_MIN_M tokens: below, the weight-only kernel reads the same bytes with no quant.
# Narrow N tiles and split-K give a 4096-wide output enough programs for 132 SMs at few tokens.
W8A8_MIN_M = 16
W8A8_CONFIGS_SMALL = tuple(W8A8Config(*c) for c in (
    (64, 32, 128, 4, 4), (64, 64, 128, 4, 4), (64, 64, 256, 4, 3), (64, 128, 128, 4, 4),
    (64, 64, 128, 4, 4, 2), (64, 32, 256, 4, 3, 2)))
W8A8_CONFIGS_LARGE = tuple(W8A8Config(*c) for c in (
    (64, 64, 128, 4, 4), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4), (128, 128, 128, 8, 3),
    (64, 128, 256, 8, 3), (128, 128, 64, 4, 4)))


def w8a8_configs_for(m: int) -> tuple[W8A8Config, ...]:
    if m < W8A8_MIN_M:
        return ()
    return W8A8_CONFIGS_SMALL if m <= 64 else W8A8_CONFIGS_LARGE


def configs_for(m: int) -> tuple[W8A16Config, ...]:
    if m == 1:
        return GEMV_CONFIGS + DOT_CONFIGS_M16[:3]
    if m <= 16:
        return DOT_CONFIGS_M16
    return DOT_CONFIGS_M64 if m <= 64 else DOT_CONFIGS_LARGE


def default_config(m: int) -> W8A16Config:
    """The config when nothing was measured (CPU, the interpreter, a shape met inside a capture)."""
    return configs_for(m)[1]


if triton is not None:

    @triton.jit
    def _store_result(acc, out_ptr, ws_ptr, offs, mask, pid_k, M, N, SPLIT_K: tl.constexpr):
        """acc (already scaled) -> out in its dtype, or split pid_k's float32 slice of the workspace."""
        if SPLIT_K == 1:
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + offs, acc, mask=mask)

    @triton.jit
    def _k_range(K, pid_k, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        num_tiles = tl.cdiv(K, BLOCK_K)
        per_split = tl.cdiv(num_tiles, SPLIT_K)
        return pid_k * per_split, tl.minimum((pid_k + 1) * per_split, num_tiles)

    @triton.jit
    def _output_tile(x_ptr, w_ptr, M, N, stride_xm, stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """This program's output rows and columns (grid: N tiles, M tiles), their bounds, and the
        row pointers of the activation and the [N, K] weight they read."""
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
        return rm, rn, rm < M, rn < N, x_rows, w_rows

    @triton.jit
    def _operand_tiles(x_rows, w_rows, kk, m_ok, n_ok, K, EVEN_K: tl.constexpr):
        """The activation's and the weight's tiles at columns kk (zeros past M, N and K)."""
        if EVEN_K:
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_ok = kk < K
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        return x, w

    # M is the step's token count: specialised on it (M == 1, M % 16), each new value class would
    # be another compile in the middle of serving.
    @triton.jit(do_not_specialize=["M"])
    def _w8a16_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, ws_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE_DOT: tl.constexpr):
        """out[M, N] = (x[M, K] @ widen(w[N, K]).T) * scale[N], or split pid_k's partial of it."""
        pid_k = tl.program_id(2)
        rm, rn, m_ok, n_ok, x_rows, w_rows = _output_tile(x_ptr, w_ptr, M, N, stride_xm, stride_wn, BLOCK_M,
                                                          BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        first, last = _k_range(K, pid_k, BLOCK_K, SPLIT_K)
        for tile in range(first, last):
            x, w = _operand_tiles(x_rows, w_rows, tile * BLOCK_K + rk, m_ok, n_ok, K, EVEN_K)
            w = w.to(x.dtype)
            if IEEE_DOT:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
        offs = rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
        _store_result(acc, out_ptr, ws_ptr, offs, m_ok[:, None] & n_ok[None, :], pid_k, M, N, SPLIT_K)

    @triton.jit(do_not_specialize=["M"])
    def _w8a8_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, ws_ptr, M, N, K, stride_am, stride_wn,
                     stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr):
        """out[M, N] = (a[M, K] @ w[N, K].T) * a_scale[M] * w_scale[N], a and w in e4m3, the
        products accumulated in float32; or split pid_k's partial of it."""
        pid_k = tl.program_id(2)
        rm, rn, m_ok, n_ok, a_rows, w_rows = _output_tile(a_ptr, w_ptr, M, N, stride_am, stride_wn, BLOCK_M,
                                                          BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        first, last = _k_range(K, pid_k, BLOCK_K, SPLIT_K)
        for tile in range(first, last):
            a, w = _operand_tiles(a_rows, w_rows, tile * BLOCK_K + rk, m_ok, n_ok, K, EVEN_K)
            acc = tl.dot(a, tl.trans(w), acc)
        a_scale = tl.load(a_scale_ptr + rm, mask=m_ok, other=0.0)
        w_scale = tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)
        acc = acc * a_scale[:, None] * w_scale[None, :]
        offs = rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
        _store_result(acc, out_ptr, ws_ptr, offs, m_ok[:, None] & n_ok[None, :], pid_k, M, N, SPLIT_K)

    @triton.jit
    def _w8a16_gemv_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, ws_ptr, N, K, stride_wn,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                           EVEN_K: tl.constexpr):
        """out[1, N] = (x[1, K] * widen(w[N, K])).sum(K) * scale[N]: each thread reads whole 16-byte
        runs of a weight row (K is contiguous), multiplies in float32 and reduces across the tile."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
        # Products summed per lane over the K tiles, reduced across lanes once at the end: no
        # shuffles inside the loop, whose only work is then the loads and the FMAs.
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        first, last = _k_range(K, pid_k, BLOCK_K, SPLIT_K)
        for tile in range(first, last):
            kk = tile * BLOCK_K + rk
            if EVEN_K:
                x = tl.load(x_ptr + kk)
                w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
            else:
                k_ok = kk < K
                x = tl.load(x_ptr + kk, mask=k_ok, other=0.0)
                w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
        acc = tl.sum(acc2, axis=1) * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)
        _store_result(acc, out_ptr, ws_ptr, rn, n_ok, pid_k, 1, N, SPLIT_K)

    @triton.jit
    def _split_k_sum_kernel(ws_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        """out[i] = sum over s of ws[s, i], cast to out's dtype (out is contiguous [M, N])."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < numel
        total = tl.zeros([BLOCK], tl.float32)
        for s in tl.static_range(SPLIT_K):
            total += tl.load(ws_ptr + s * numel + offs, mask=ok, other=0.0)
        tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


SUM_BLOCK = 1024


def w8a16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
          config: W8A16Config | None = None) -> torch.Tensor:
    """x: [M, K] (bf16, or float32 in tests; last dim contiguous); weight: [N, K] e4m3 or int8,
    scale: [N] float32 -> x @ (weight * scale).T: [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    config = config or default_config(m)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if not m:
        return out
    split = min(config.split_k, triton.cdiv(k, config.block_k))
    # Every element of the workspace is written by exactly one program: torch.empty, no memset.
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    even_k = k % config.block_k == 0
    grid_n = triton.cdiv(n, config.block_n)
    if config.gemv and m == 1:
        _w8a16_gemv_kernel[(grid_n, split)](
            x, weight, scale, out, ws, n, k, weight.stride(0), BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, SPLIT_K=split, EVEN_K=even_k, num_warps=config.num_warps,
            num_stages=config.num_stages)
    else:
        block_m = block_m_for(m)
        _w8a16_kernel[(grid_n, triton.cdiv(m, block_m), split)](
            x, weight, scale, out, ws, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
            BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split, EVEN_K=even_k,
            IEEE_DOT=x.dtype == torch.float32, num_warps=config.num_warps, num_stages=config.num_stages)
    if split > 1:
        _sum_split(ws, out, split)
    return out


def _sum_split(ws: torch.Tensor, out: torch.Tensor, split: int) -> None:
    numel = out.numel()
    _split_k_sum_kernel[(triton.cdiv(numel, SUM_BLOCK),)](ws, out, numel, SPLIT_K=split, BLOCK=SUM_BLOCK,
                                                          num_warps=4)


def w8a8(xq: QuantizedActivation, weight: torch.Tensor, scale: torch.Tensor,
         config: W8A8Config | None = None) -> torch.Tensor:
    """xq: [M, K] e4m3 with [M, 1] float32 scales (contiguous rows); weight: [N, K] e4m3, scale:
    [N] float32 -> (xq.data * xq.scale) @ (weight * scale).T: [M, N] in xq.dtype."""
    m, k = xq.data.shape
    n = weight.shape[0]
    config = config or W8A8_CONFIGS_SMALL[1]
    out = torch.empty((m, n), dtype=xq.dtype, device=weight.device)
    if not m:
        return out
    split = min(config.split_k, triton.cdiv(k, config.block_k))
    ws = torch.empty((split, m, n), dtype=torch.float32, device=weight.device) if split > 1 else out
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), split)
    _w8a8_kernel[grid](
        xq.data, xq.scale, weight, scale, out, ws, m, n, k, xq.data.stride(0), weight.stride(0),
        out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split,
        EVEN_K=k % config.block_k == 0, num_warps=config.num_warps, num_stages=config.num_stages)
    if split > 1:
        _sum_split(ws, out, split)
    return out


def scaled_mm(xq: QuantizedActivation, weight: torch.Tensor, scale: torch.Tensor, *,
              use_fast_accum: bool = True) -> torch.Tensor:
    """xq: [M, K] e4m3 with [M, 1] scales; weight: [N, K] e4m3, scale: [N] -> [M, N] in xq.dtype."""
    return torch._scaled_mm(xq.data, weight.t(), scale_a=xq.scale, scale_b=scale.unsqueeze(0),
                            out_dtype=xq.dtype, use_fast_accum=use_fast_accum)
