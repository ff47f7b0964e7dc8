"""The LoRA expand of every row's own adapter in one Triton kernel, for steps of any size.

The shrink A @ x of every slot comes out of the base product itself (workers/lora/layers.py
stacks every slot's A under the base weight), so a projection with adapters is one GEMM and
this one kernel - no more launches than that, whatever the mix: at Llama-3-8B's shape a decode
step has 128 projections, and every extra kernel there costs a few microseconds, adapters or
not. Here each program takes a tile of rows and of output columns and, for each slot one of
its rows is on, adds that slot's rows of B^T times those rows' shrink (rows on other slots
masked to zero), then writes base + delta:

    out[t, :] = base[t, :] + shrink[t, cols of slot(t)] @ Bt[cols of slot(t), :]
    shrink: [n, slots * width]    Bt: [slots * width, out] (B transposed: a tile reads whole rows)

A slot no row of the tile is on is skipped, so a decode row reads only its own slot's B; a
row of slot 0 (the base) adds nothing. The grid depends on n and out alone, so CUDA graphs
replay it for any mix of adapters.
"""

from __future__ import annotations

import torch

from workers.layers.triton_import import tl, triton

if triton is not None:

    @triton.jit
    def _expand_kernel(shrink_ptr, bt_ptr, slots_ptr, base_ptr, out_ptr, num_rows, out_features, width,
                       num_slots, stride_shrink, stride_bt, stride_base, stride_out,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                       IEEE: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < num_rows
        row_slots = tl.load(slots_ptr + rows, mask=row_mask, other=0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < out_features
        w = tl.arange(0, BLOCK_W)
        w_mask = w < width
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for slot in range(1, num_slots):
            on_slot = row_slots == slot
            if tl.max(on_slot.to(tl.int32), axis=0) > 0:  # some row of this tile is on the slot
                s = tl.load(shrink_ptr + rows[:, None] * stride_shrink + (slot * width + w)[None, :],
                            mask=on_slot[:, None] & w_mask[None, :], other=0.0)
                b = tl.load(bt_ptr + (slot * width + w)[:, None] * stride_bt + cols[None, :],
                            mask=w_mask[:, None] & col_mask[None, :], other=0.0)
                if IEEE:  # float32 weights: no TF32 rounding of the product
                    acc += tl.dot(s, b, input_precision="ieee")
                else:
                    acc += tl.dot(s, b)
        mask = row_mask[:, None] & col_mask[None, :]
        base = tl.load(base_ptr + rows[:, None] * stride_base + cols[None, :], mask=mask, other=0.0)
        total = (base.to(tl.float32) + acc).to(base.dtype)
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], total, mask=mask)


def expand_lora(shrink: torch.Tensor, base: torch.Tensor, lora_bt: torch.Tensor, token_slots: torch.Tensor,
                width: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = base + each row's delta (see the module's docstring); a new tensor unless `out` is
    given (it may be `base` itself).
    shrink: [n, slots * width] and base: [n, out_features], rows of contiguous columns (any row
    stride: both may be column slices of one product); lora_bt: [slots * width, out_features];
    token_slots: [>= n] long, each row's slot (0: the base)."""
    n, out_features = base.shape
    if shrink.stride(1) != 1 or base.stride(1) != 1:
        raise ValueError("the LoRA expand reads rows of contiguous columns")
    if out is None:
        out = torch.empty(n, out_features, dtype=base.dtype, device=base.device)
    num_slots = lora_bt.shape[0] // width
    block_m = 16 if n <= 16 else 64  # tl.dot's smallest tile; decode steps waste the rest
    block_n = 64 if n <= 16 else 128
    grid = (triton.cdiv(n, block_m), triton.cdiv(out_features, block_n))
    _expand_kernel[grid](shrink, lora_bt, token_slots, base, out, n, out_features, width, num_slots,
                         shrink.stride(0), lora_bt.stride(0), base.stride(0), out.stride(0),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_W=max(16, triton.next_power_of_2(width)),
                         IEEE=lora_bt.dtype == torch.float32)
    return out
