"""A tensor-parallel projection with the LoRA deltas of the adapters in a runner's slots.

`LoraProjection` wraps one of a layer's linears once its weights are loaded (only when the
engine serves adapters: otherwise nothing is wrapped and the base path is untouched). It
holds the slots of its sub-projections' (q, k, v of the fused qkv_proj; gate, up of
gate_up_proj; o_proj and down_proj alone) A and B, ranks zero-padded to max_rank; slot 0 is the
base (no adapter). Under TP each rank holds the slices its base layer holds: a
column-parallel sub-projection the rows of B that match its output rows (A whole), a
row-parallel one the columns of A that match its input columns (B whole) - its partial
B @ A @ x is summed by the same all-reduce as the base's partial product.

The step's tokens are grouped by slot (`LoraBatch`, set once per step by the manager), and each
group adds B @ (A @ x) for its rows: segment-wise plain torch, a matmul pair per adapter in
the step, not per token, whatever its sub-projections.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from workers.layers.linear import LinearBase, RowParallelLinear


@dataclass
class SlotGroup:
    slot: int
    # The step's rows (tokens) on this adapter: a slice when they follow each other (one
    # request, or neighbours), else an index tensor [n] long.
    rows: slice | torch.Tensor


@dataclass
class LoraBatch:
    """The current step's tokens by adapter slot; empty: no token uses an adapter."""

    groups: list[SlotGroup] = field(default_factory=list)


@dataclass(frozen=True)
class SubProjection:
    name: str  # PEFT's projection name (q_proj...)
    out_offset: int  # where its rows start in this rank's output
    out_rows: tuple[int, int]  # (start, size): this rank's rows of the full projection (B's rows)
    in_cols: tuple[int, int] | None  # (start, size) of A's columns on this rank; None: all


class LoraProjection(nn.Module):
    def __init__(self, base: LinearBase, subs: list[SubProjection], in_features: int, num_slots: int,
                 max_rank: int, batch: LoraBatch) -> None:
        super().__init__()
        self.base = base
        self.subs = subs
        self.max_rank = max_rank
        self.batch = batch
        self.is_row_parallel = isinstance(base, RowParallelLinear)
        weight = base.weight
        dtype = weight.dtype if weight.dtype.is_floating_point and weight.element_size() > 1 else None
        dtype = dtype or torch.get_default_dtype()
        out_features = sum(sub.out_rows[1] for sub in subs)
        width = len(subs) * max_rank  # sub-projection i owns columns [i * max_rank, (i + 1) * max_rank)
        # The sub-projections' A stacked: [slots, subs * max_rank, in (this rank's)]; their B as
        # one block-diagonal [slots, out (this rank's), subs * max_rank]: a group's whole delta
        # is then one matmul pair, whatever the sub-projections and the ranks.
        device = weight.device
        self.lora_a = nn.Parameter(torch.zeros(num_slots, width, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.lora_b = nn.Parameter(torch.zeros(num_slots, out_features, width, dtype=dtype, device=device),
                                   requires_grad=False)
        self.active = [False] * num_slots  # slot -> whether any sub-projection has a delta there

    def takes_fp8_input(self, x: torch.Tensor) -> bool:
        return False  # the deltas need x itself, not its e4m3 rows

    def load_slot(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fill `slot` with one (A [rank, in], B [out, rank]) per sub-projection, whole as the
        file has them (None: no delta there); this rank keeps its slices."""
        a_slot, b_slot = self.lora_a[slot], self.lora_b[slot]
        a_slot.zero_()
        b_slot.zero_()
        self.active[slot] = any(pair is not None for pair in pairs)
        for index, (sub, pair) in enumerate(zip(self.subs, pairs, strict=True)):
            if pair is None:
                continue
            a, b = pair
            rank = a.shape[0]
            if sub.in_cols is not None:
                a = a[:, sub.in_cols[0] : sub.in_cols[0] + sub.in_cols[1]]
            start, size = sub.out_rows
            cols = slice(index * self.max_rank, index * self.max_rank + rank)
            a_slot[cols].copy_(a)
            b_slot[sub.out_offset : sub.out_offset + size, cols].copy_(b[start : start + size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in (this rank's)] -> [num_tokens, out (this rank's)]
        base = self.base
        y = base._matmul(x) if self.is_row_parallel else base(x)
        for group in self.batch.groups:
            if not self.active[group.slot]:
                continue
            rows = group.rows
            xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)  # [n, in]
            delta = (xs @ self.lora_a[group.slot].t()) @ self.lora_b[group.slot].t()  # [n, out]
            if isinstance(rows, slice):
                y[rows] += delta
            else:
                y.index_add_(0, rows, delta)
        if self.is_row_parallel:
            y = base.tp.all_reduce(y)
            if base.bias is not None:
                y = y + base.bias
        return y
