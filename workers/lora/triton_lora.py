"""The LoRA delta of each token's own adapter, in two Triton kernels (as Punica's BGMV: a
matrix-vector product per token row, its adapter picked by the row's slot), for steps of few
tokens (decodes, small mixed steps), where the dense path's product over every slot reads every
slot's weights. Fixed grids, so CUDA graphs replay them for any mix.

    partial[t, c, :] = A[slot(t)][:, chunk c] @ x[t, chunk c]   A: [slots * width, in]
    y[t, :]         += B[:, slot(t)] @ sum_c partial[t, c, :]    B: [out, slots * width]

The shrink is split over chunks of the input (rows x chunks programs) and the expand sums the
chunks' partials in a fixed order: one program per row read a slot's whole A alone on one SM,
36 us a kernel at batch 1 on an H100, 2.5x the base's decode step. A row of slot 0 (the base)
reads nothing and adds nothing.
"""

from __future__ import annotations

import torch

from workers.layers.triton_import import tl, triton

# Steps of at most this many rows take the kernels; larger ones the dense path. Each row here
# reads its slot's A and B again (2.7 MB a layer at Llama-3-8B's shape, rank 16 on all seven
# projections), where a GEMM reads every slot's once for all rows: at 256 rows on the kernels a
# burst over 8 adapters ran at 0.58 of the base on an H100.
MAX_ROWS = 32
# Input columns per shrink program.
CHUNK = 256

if triton is not None:

    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, slots_ptr, partial_ptr, in_features, width,
                       stride_x, stride_a, stride_row, stride_chunk,
                       BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        slot = tl.load(slots_ptr + row)
        if slot == 0:  # the expand skips this row too, so its partials are never read
            return
        w = tl.arange(0, BLOCK_W)
        w_mask = w < width
        acc = tl.zeros([BLOCK_W], dtype=tl.float32)
        a_rows = a_ptr + (slot * width + w)[:, None] * stride_a
        for step in range(CHUNK // BLOCK_K):
            k = chunk * CHUNK + step * BLOCK_K + tl.arange(0, BLOCK_K)
            k_mask = k < in_features
            xk = tl.load(x_ptr + row * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
            a = tl.load(a_rows + k[None, :], mask=w_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * xk[None, :], axis=1)
        tl.store(partial_ptr + row * stride_row + chunk * stride_chunk + w, acc, mask=w_mask)

    @triton.jit
    def _expand_kernel(partial_ptr, b_ptr, slots_ptr, y_ptr, out_features, width, num_chunks,
                       stride_row, stride_chunk, stride_b, stride_y,
                       BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr):
        row = tl.program_id(0)
        slot = tl.load(slots_ptr + row)
        if slot == 0:
            return
        w = tl.arange(0, BLOCK_W)
        w_mask = w < width
        c = tl.arange(0, BLOCK_C)
        partials = tl.load(partial_ptr + row * stride_row + c[:, None] * stride_chunk + w[None, :],
                           mask=(c < num_chunks)[:, None] & w_mask[None, :], other=0.0)
        s = tl.sum(partials, axis=0)  # [BLOCK_W]: A[slot] @ x[row]
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < out_features
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
    num_chunks = triton.cdiv(in_features, CHUNK)
    partial = torch.empty(n, num_chunks, width, dtype=torch.float32, device=x.device)
    block_w = triton.next_power_of_2(width)
    _shrink_kernel[(n, num_chunks)](x, lora_a, token_slots, partial, in_features, width,
                                    x.stride(0), lora_a.stride(0), partial.stride(0), partial.stride(1),
                                    BLOCK_W=block_w, BLOCK_K=64, CHUNK=CHUNK)
    block_n = 64
    _expand_kernel[(n, triton.cdiv(out_features, block_n))](
        partial, lora_b, token_slots, y, out_features, width, num_chunks,
        partial.stride(0), partial.stride(1), lora_b.stride(0), y.stride(0),
        BLOCK_W=block_w, BLOCK_C=triton.next_power_of_2(num_chunks), BLOCK_N=block_n)
