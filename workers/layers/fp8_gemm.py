"""The FP8 linear's matrix product on CUDA, picked per call by the number of tokens.

Two kernels, chosen by measurement (`scripts/bench_quant.py --linears`, table in
docs/quantization.md):
- `scaled_mm`: `torch._scaled_mm` on e4m3 activations (one scale per token) and e4m3 weights
  (one per channel) with fast accumulation. Without `use_fast_accum` the rowwise product is
  slower than bf16 at every M (pytorch #147971); with it, it is 1.7-1.8x faster than bf16 at
  M = 2048 on an H200. It needs the activation quantized first (triton_quant.py).
- `w8a16`: a Triton kernel for few tokens. Decode steps read every weight once for a handful of
  rows, so the product is bound by the weight bytes: this kernel keeps the activation in bf16
  (no quant at all) and widens each e4m3 weight tile to bf16 in registers, so it reads half of
  bf16's bytes. Split-K (float32 atomics) gives small outputs enough programs to fill the GPU.

`SMALL_M_MAX` is where the first stops winning; an FP8 linear asks `takes_fp8_input(num_tokens)`
so that the kernel before it (RMSNorm, SiLU-mul) fuses the quant only where scaled_mm will run.
"""

from __future__ import annotations

import functools

import torch

from workers.layers.fp8 import QuantizedActivation
from workers.layers.triton_import import is_available, tl, triton  # noqa: F401 - is_available is this module's API too

# Steps of up to this many tokens take the w8a16 kernel, larger ones scaled_mm. Provisional:
# the H200 profile has rowwise _scaled_mm no faster than bf16 up to M = 16 and a
# weight-bound product at these sizes; to be confirmed by `bench_quant.py --linears` there.
SMALL_M_MAX = 16
W8A16_BLOCK_N = 64
W8A16_BLOCK_K = 128
W8A16_NUM_WARPS = 4
W8A16_NUM_STAGES = 4
MAX_SPLIT_K = 8


if triton is not None:

    # M is the step's token count: specialised on it (M == 1, M % 16), each new value class would
    # be another compile in the middle of serving.
    @triton.jit(do_not_specialize=["M"])
    def _w8a16_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT_K: tl.constexpr, IEEE_DOT: tl.constexpr):
        """out[M, N] (+)= (x[M, K] @ widen(w[N, K]).T) * scale[N]; SPLIT_K > 1 adds float32
        partials of K ranges into a zeroed out."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        num_tiles = tl.cdiv(K, BLOCK_K)
        tiles_per_split = tl.cdiv(num_tiles, SPLIT_K)
        tile_end = tl.minimum((pid_k + 1) * tiles_per_split, num_tiles)
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for tile in range(pid_k * tiles_per_split, tile_end):
            kk = tile * BLOCK_K + rk
            k_ok = kk < K
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(x.dtype)
            if IEEE_DOT:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
        offs = rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(out_ptr + offs, acc, mask=mask)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_k_for(num_programs: int, num_k_tiles: int, device: torch.device) -> int:
    """K splits that give ~2 programs per SM (the interpreter: 2, to exercise the split path)."""
    if device.type != "cuda":
        return 2 if num_k_tiles > 1 else 1
    target = 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    split = 1
    while split < MAX_SPLIT_K and num_programs * split < target and split * 2 <= num_k_tiles:
        split *= 2
    return split


def w8a16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, block_n: int = W8A16_BLOCK_N,
          block_k: int = W8A16_BLOCK_K, split_k: int | None = None, num_warps: int = W8A16_NUM_WARPS,
          num_stages: int = W8A16_NUM_STAGES) -> torch.Tensor:
    """x: [M, K] (bf16, or float32 in tests); weight: [N, K] e4m3 (or int8), scale: [N] float32
    -> x @ (weight * scale).T: [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)  # tl.dot's smallest M is 16
    grid_n, grid_m = triton.cdiv(n, block_n), triton.cdiv(m, block_m)
    if split_k is None:
        split_k = split_k_for(grid_n * grid_m, triton.cdiv(k, block_k), x.device)
    if split_k > 1:
        out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        _w8a16_kernel[(grid_n, grid_m, split_k)](
            x, weight, scale, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
            IEEE_DOT=x.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
        )
    return out if split_k == 1 else out.to(x.dtype)


def scaled_mm(xq: QuantizedActivation, weight: torch.Tensor, scale: torch.Tensor, *,
              use_fast_accum: bool = True) -> torch.Tensor:
    """xq: [M, K] e4m3 with [M, 1] scales; weight: [N, K] e4m3, scale: [N] -> [M, N] in xq.dtype."""
    return torch._scaled_mm(xq.data, weight.t(), scale_a=xq.scale, scale_b=scale.unsqueeze(0),
                            out_dtype=xq.dtype, use_fast_accum=use_fast_accum)


def uses_w8a16(num_tokens: int, device: torch.device) -> bool:
    return triton is not None and device.type == "cuda" and num_tokens <= SMALL_M_MAX
