"""A tensor-parallel projection with the LoRA deltas of the adapters in a runner's slots.

`LoraProjection` wraps one of a layer's linears once its weights are loaded (only when the
engine serves adapters: otherwise nothing is wrapped and the base path is untouched). It
holds, per sub-projection (q, k, v of the fused qkv_proj; gate, up of gate_up_proj; o_proj and
down_proj alone), stacked slots of A [slots, max_rank, in] and B [slots, out, max_rank]; slot 0
is the base (no adapter). Under TP each rank holds the slices its base layer holds: a
column-parallel sub-projection the rows of B that match its output rows (A whole), a
row-parallel one the columns of A that match its input columns (B whole) - its partial
B @ A @ x is summed by the same all-reduce as the base's partial product.

The step's tokens are grouped by slot (`LoraBatch`, set once per step by the manager), and each
group adds B @ (A @ x) for its rows: segment-wise plain torch, a matmul pair per adapter in
the step, not per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from workers.layers.linear import LinearBase, RowParallelLinear


@dataclass
class SlotGroup:
    slot: int
    rank: int  # the adapter's rank: only the first `rank` rows of A (columns of B) are used
    rows: torch.Tensor  # [n] long: the step's rows (tokens) on this adapter


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
        self.batch = batch
        self.is_row_parallel = isinstance(base, RowParallelLinear)
        weight = base.weight
        dtype = weight.dtype if weight.dtype.is_floating_point and weight.element_size() > 1 else None
        dtype = dtype or torch.get_default_dtype()
        device = weight.device
        # A per sub-projection: [slots, max_rank, in (this rank's)]; B: [slots, out rows, max_rank]
        self.lora_a = nn.ParameterList(
            nn.Parameter(torch.zeros(num_slots, max_rank, in_features, dtype=dtype, device=device),
                         requires_grad=False) for _ in subs)
        self.lora_b = nn.ParameterList(
            nn.Parameter(torch.zeros(num_slots, sub.out_rows[1], max_rank, dtype=dtype, device=device),
                         requires_grad=False) for sub in subs)
        # slot -> whether each sub-projection has a delta there (host side: skipped when not)
        self.active = [[False] * len(subs) for _ in range(num_slots)]

    def takes_fp8_input(self, x: torch.Tensor) -> bool:
        return False  # the deltas need x itself, not its e4m3 rows

    def load_slot(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fill `slot` with one (A [rank, in], B [out, rank]) per sub-projection, whole as the
        file has them (None: no delta there); this rank keeps its slices."""
        for index, (sub, pair) in enumerate(zip(self.subs, pairs, strict=True)):
            a_slot, b_slot = self.lora_a[index][slot], self.lora_b[index][slot]
            a_slot.zero_()
            b_slot.zero_()
            self.active[slot][index] = pair is not None
            if pair is None:
                continue
            a, b = pair
            rank = a.shape[0]
            if sub.in_cols is not None:
                a = a[:, sub.in_cols[0] : sub.in_cols[0] + sub.in_cols[1]]
            start, size = sub.out_rows
            a_slot[:rank].copy_(a)
            b_slot[:, :rank].copy_(b[start : start + size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in (this rank's)] -> [num_tokens, out (this rank's)]
        base = self.base
        y = base._matmul(x) if self.is_row_parallel else base(x)
        for group in self.batch.groups:
            flags = self.active[group.slot]
            if not any(flags):
                continue
            xs = x.index_select(0, group.rows)
            for index, sub in enumerate(self.subs):
                if not flags[index]:
                    continue
                a = self.lora_a[index][group.slot, : group.rank]  # [rank, in]
                b = self.lora_b[index][group.slot, :, : group.rank]  # [out, rank]
                delta = (xs @ a.t()) @ b.t()  # [n, out]
                y[:, sub.out_offset : sub.out_offset + sub.out_rows[1]].index_add_(0, group.rows, delta)
        if self.is_row_parallel:
            y = base.tp.all_reduce(y)
            if base.bias is not None:
                y = y + base.bias
        return y
