"""The LoRA delta of each token's own adapter, in two Triton kernels (as Punica's BGMV: a
matrix-vector product per token row, its adapter picked by the row's slot), for steps of few
tokens (decodes, small mixed steps), where the dense path's product over every slot reads every
slot's weights. Fixed grids (rows x output blocks), so CUDA graphs replay them for any mix.

    shrink[t, :] = A[slot(t)] @ x[t]        A: [slots * width, in], rows of slot s from s * width
    y[t, :]     += B[:, slot(t)] @ shrink[t]  B: [out, slots * width]

A row of slot 0 (the base) reads nothing and adds nothing.
"""

from __future__ import annotations

import torch

from workers.layers.triton_import import tl, triton

# Steps of at most this many rows take the kernels; larger ones the dense path (a GEMM reuses
# each weight tile over many rows, which these kernels do not).
MAX_ROWS = 256

if triton is not None:

    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, in_features, width,
                       stride_x, stride_a, stride_out,
                       BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(0)
        slot = tl.load(slots_ptr + row)
        w = tl.arange(0, BLOCK_W)
        w_mask = w < width
        if slot == 0:
            tl.store(out_ptr + row * stride_out + w, tl.zeros([BLOCK_W], dtype=tl.float32), mask=w_mask)
            return
        acc = tl.zeros([BLOCK_W], dtype=tl.float32)
        a_rows = a_ptr + (slot * width + w)[:, None] * stride_a
        for k0 in range(0, in_features, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < in_features
            xk = tl.load(x_ptr + row * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
            a = tl.load(a_rows + k[None, :], mask=w_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * xk[None, :], axis=1)
        tl.store(out_ptr + row * stride_out + w, acc, mask=w_mask)

    @triton.jit
    def _expand_kernel(shrink_ptr, b_ptr, slots_ptr, y_ptr, out_features, width,
                       stride_shrink, stride_b, stride_y,
                       BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr):
        row = tl.program_id(0)
        slot = tl.load(slots_ptr + row)
        if slot == 0:
            return
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < out_features
        w = tl.arange(0, BLOCK_W)
        w_mask = w < width
        s = tl.load(shrink_ptr + row * stride_shrink + w, mask=w_mask, other=0.0)
        b = tl.load(b_ptr + n[:, None] * stride_b + (slot * width + w)[None, :],
                    mask=n_mask[:, None] & w_mask[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(b * s[None, :], axis=1)
        y = tl.load(y_ptr + row * stride_y + n, mask=n_mask, other=0.0)
        tl.store(y_ptr + row * stride_y + n, (y.to(tl.float32) + delta).to(y.dtype), mask=n_mask)


def add_lora(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             token_slots: torch.Tensor, width: int) -> None:
    """y[t] += B[:, slot t] @ (A[slot t] @ x[t]) for every row t, in place.
    x: [n, in]; y: [n, out], rows contiguous; lora_a: [slots * width, in]; lora_b: [out, slots * width];
    token_slots: [n] long (0: the base)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if y.stride(1) != 1:
        raise ValueError("the LoRA kernels add into rows of contiguous columns")
    n, in_features = x.shape
    out_features = y.shape[1]
    shrink = torch.empty(n, width, dtype=torch.float32, device=x.device)
    block_w = triton.next_power_of_2(width)
    _shrink_kernel[(n,)](x, lora_a, token_slots, shrink, in_features, width,
                         x.stride(0), lora_a.stride(0), shrink.stride(0), BLOCK_W=block_w, BLOCK_K=64)
    block_n = 64
    _expand_kernel[(n, triton.cdiv(out_features, block_n))](
        shrink, lora_b, token_slots, y, out_features, width, shrink.stride(0), lora_b.stride(0), y.stride(0),
        BLOCK_W=block_w, BLOCK_N=block_n)
