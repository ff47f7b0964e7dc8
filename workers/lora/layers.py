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

from workers.layers import triton_import
from workers.layers.linear import LinearBase, RowParallelLinear
from workers.lora import triton_lora


@dataclass
class SlotGroup:
    slot: int
    # The step's rows (tokens) on this adapter: a slice when they follow each other (one
    # request, or neighbours), else an index tensor [n] long.
    rows: slice | torch.Tensor


@dataclass
class LoraBatch:
    """The current step's tokens by adapter slot, set once per step by the manager.

    Segment-wise (`groups`; empty: no token uses an adapter), or dense (`token_slots` set: a
    fixed device buffer holding each row's slot, read by CUDA graphs as by eager steps)."""

    groups: list[SlotGroup] = field(default_factory=list)
    token_slots: torch.Tensor | None = None  # [max rows] long: each row's slot (0: the base)
    use_dense: bool = False

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
        # a slot's columns; sub-projection i has [i * max_rank, (i + 1) * max_rank) of them
        self.width = width = len(subs) * max_rank
        device = weight.device
        # Slot s owns rows [s * width, (s + 1) * width) of A: its sub-projections' A stacked,
        # [slots * width, in (this rank's)]; and those columns of B: their B as one block-diagonal,
        # [out (this rank's), slots * width]. A group's whole delta is one matmul pair, whatever
        # the sub-projections and the ranks; the dense path's is one pair for every slot at once.
        self.lora_a = nn.Parameter(torch.zeros(num_slots * width, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.lora_b = nn.Parameter(torch.zeros(out_features, num_slots * width, dtype=dtype, device=device),
                                   requires_grad=False)
        # column of the dense shrink -> its slot
        self.register_buffer("column_slots", torch.arange(num_slots * width, device=device) // width,
                             persistent=False)
        self.active = [False] * num_slots  # slot -> whether any sub-projection has a delta there

    def takes_fp8_input(self, x: torch.Tensor) -> bool:
        return False  # the deltas need x itself, not its e4m3 rows

    def load_slot(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fill `slot` with one (A [rank, in], B [out, rank]) per sub-projection, whole as the
        file has them (None: no delta there); this rank keeps its slices."""
        columns = slice(slot * self.width, (slot + 1) * self.width)
        a_slot, b_slot = self.lora_a[columns], self.lora_b[:, columns]
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
        if self.batch.use_dense:
            self._add_dense(x, y)
        for group in self.batch.groups:
            if not self.active[group.slot]:
                continue
            rows = group.rows
            xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)  # [n, in]
            columns = slice(group.slot * self.width, (group.slot + 1) * self.width)
            delta = (xs @ self.lora_a[columns].t()) @ self.lora_b[:, columns].t()  # [n, out]
            if isinstance(rows, slice):
                y[rows] += delta
            else:
                y.index_add_(0, rows, delta)
        if self.is_row_parallel:
            y = base.tp.all_reduce(y)
            if base.bias is not None:
                y = y + base.bias
        return y

    def _add_dense(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Every row against every slot's A, each row keeping its own slot's columns, then B: fixed
        shapes and no host decision, so a CUDA graph replays it for any mix of adapters."""
        slots = self.batch.token_slots[: x.shape[0]]  # [n]
        if triton_import.is_available(x) and x.shape[0] <= triton_lora.MAX_ROWS:
            # Few rows (decodes): each row reads its own slot's weights only (workers/lora/triton_lora.py).
            triton_lora.add_lora(x, y, self.lora_a, self.lora_b, slots, self.width)
            return
        shrink = x @ self.lora_a.t()  # [n, slots * width]
        shrink.masked_fill_(self.column_slots != slots[:, None], 0)
        y.addmm_(shrink, self.lora_b.t())  # y += shrink @ B.T
