"""Dynamic per-token FP8 activation quantization on CUDA (Triton), one kernel per linear input.

PyTorch needs about nine kernels to quantize an activation (abs, amax, divide, clamp, casts):
15-110 us per linear on an H200 even inside a CUDA graph. Here each row is read once; its amax,
its scale (amax / 448, as float32) and its e4m3 values come out of the same program. Where a
quantized linear follows an RMSNorm (qkv, gate_up) or the SiLU-mul (down), the quant is fused
into that kernel, so the normed or activated row never goes to memory in bf16 at all.

The rounding points are the unfused code's: the row is first rounded to the activations' dtype
(what RMSNorm or silu-mul would store), then scaled and cast, so fused and unfused fp8 linears
see the same e4m3 bytes (Fp8Quantization.quantize_activation is the PyTorch reference).
Every launch has a grid fixed by the tensors' shapes: all are captured in the CUDA graphs.
"""

from __future__ import annotations

import torch

from workers.layers.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, QuantizedActivation
from workers.layers.triton_import import is_available, tl, triton  # noqa: F401 - is_available is this module's API too

if triton is not None:
    from workers.layers.triton_fused import rms_norm_row

    @triton.jit
    def _quantize_row(y, out_ptr, scale_ptr, row, cols, mask, N: tl.constexpr, FP8_MAX_: tl.constexpr,
                      MIN_SCALE_: tl.constexpr):
        """y: one row in float32 (already rounded to the activations' dtype) -> e4m3 + scale."""
        amax = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0)
        scale = tl.maximum(amax / FP8_MAX_, MIN_SCALE_)
        q = tl.clamp(y / scale, -FP8_MAX_, FP8_MAX_)
        tl.store(out_ptr + row * N + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)

    @triton.jit
    def _per_token_quant_kernel(x_ptr, out_ptr, scale_ptr, stride_x, N: tl.constexpr, BLOCK: tl.constexpr,
                                FP8_MAX_: tl.constexpr, MIN_SCALE_: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        y = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        _quantize_row(y, out_ptr, scale_ptr, row, cols, mask, N, FP8_MAX_, MIN_SCALE_)

    @triton.jit
    def _rms_norm_quant_kernel(x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr, res_out_ptr, stride_x, stride_res,
                               eps, N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                               FP8_MAX_: tl.constexpr, MIN_SCALE_: tl.constexpr):
        # triton_fused's RMSNorm row, then quantized instead of stored.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        y = rms_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, cols, mask, stride_x, stride_res, eps, N,
                         HAS_RESIDUAL)
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        _quantize_row(y, out_ptr, scale_ptr, row, cols, mask, N, FP8_MAX_, MIN_SCALE_)

    @triton.jit
    def _silu_and_mul_quant_kernel(x_ptr, out_ptr, scale_ptr, stride_x, N: tl.constexpr, BLOCK: tl.constexpr,
                                   FP8_MAX_: tl.constexpr, MIN_SCALE_: tl.constexpr):
        # triton_fused._silu_and_mul_kernel's arithmetic over the whole row, then quantized.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        y = (act * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
        _quantize_row(y, out_ptr, scale_ptr, row, cols, mask, N, FP8_MAX_, MIN_SCALE_)


def _outputs(num_tokens: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((num_tokens, width), dtype=FP8_DTYPE, device=device),
            torch.empty((num_tokens, 1), dtype=torch.float32, device=device))


def _num_warps(block: int) -> int:
    return min(16, max(1, block // 256))


def per_token_quant(x: torch.Tensor) -> QuantizedActivation:
    """x: [num_tokens, width] (last dim contiguous) -> its e4m3 rows and their float32 scales."""
    return _quantized_rows(_per_token_quant_kernel, x, x.shape[1])


def _quantized_rows(kernel, x: torch.Tensor, width: int) -> QuantizedActivation:
    """One program per row of x, each writing `width` e4m3 values and their scale."""
    num_tokens = x.shape[0]
    data, scale = _outputs(num_tokens, width, x.device)
    if num_tokens:
        block = triton.next_power_of_2(width)
        kernel[(num_tokens,)](x, data, scale, x.stride(0), N=width, BLOCK=block, FP8_MAX_=FP8_MAX,
                              MIN_SCALE_=MIN_SCALE, num_warps=_num_warps(block))
    return QuantizedActivation(data, scale, x.dtype)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[QuantizedActivation, torch.Tensor | None]:
    """x, residual: [num_tokens, hidden] -> (quant(norm(x [+ residual])), x + residual or None)"""
    num_tokens, hidden = x.shape
    data, scale = _outputs(num_tokens, hidden, x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        source = residual if residual is not None else x
        _rms_norm_quant_kernel[(num_tokens,)](
            x, source, weight, data, scale, res_out if res_out is not None else x, x.stride(0),
            source.stride(0), eps, N=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, FP8_MAX_=FP8_MAX,
            MIN_SCALE_=MIN_SCALE, num_warps=_num_warps(block),
        )
    return QuantizedActivation(data, scale, x.dtype), res_out


def silu_and_mul_quant(x: torch.Tensor) -> QuantizedActivation:
    """x: [num_tokens, 2 * inter] (gate then up) -> quant(silu(gate) * up): [num_tokens, inter]"""
    return _quantized_rows(_silu_and_mul_quant_kernel, x, x.shape[1] // 2)
