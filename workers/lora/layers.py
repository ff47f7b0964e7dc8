"""A tensor-parallel projection with the LoRA deltas of the adapters in a runner's slots.

`LoraProjection` wraps one of a layer's linears once its weights are loaded (only when the
engine serves adapters: otherwise nothing is wrapped and the base path is untouched). It
holds the slots of its sub-projections' (q, k, v of the fused qkv_proj; gate, up of
gate_up_proj; o_proj and down_proj alone) A and B, ranks zero-padded to max_rank; slot 0 is the
base (no adapter). Every slot's A sits under the base weight, so the base product also gives
each row's shrink A @ x for every slot; B is kept transposed. Under TP each rank holds the
slices its base layer holds: a column-parallel sub-projection the rows of B that match its
output rows (A whole), a row-parallel one the columns of A that match its input columns (B
whole) - its partial B @ A @ x is summed by the same all-reduce as the base's partial product.

The step's tokens by slot (`LoraBatch`, set once per step by the manager) pick which columns
of the shrink each row keeps: segment-wise plain torch (a matmul per adapter in the step) on
CPU, or dense - every row at once, in one Triton kernel on CUDA - where CUDA graphs replay it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
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
        self.out_features = out_features = sum(sub.out_rows[1] for sub in subs)
        # a slot's columns; sub-projection i has [i * max_rank, (i + 1) * max_rank) of them
        self.width = width = len(subs) * max_rank
        num_columns = num_slots * width
        # Slot s owns rows [s * width, (s + 1) * width) of A: its sub-projections' A stacked,
        # [slots * width, in (this rank's)]; and those rows of B^T: their B as one block-diagonal,
        # transposed, [slots * width, out (this rank's)]. A group's whole delta is one matmul pair,
        # whatever the sub-projections and the ranks.
        # Every slot's A stacked under the base weight: one GEMM gives the base product and every
        # slot's shrink (2.6% more rows at Llama-3-8B's shape, rank 16, 8 slots), so an adapter
        # adds one kernel per projection, not two (workers/lora/triton_lora.py). The runner
        # serves adapters on unquantized weights only.
        dtype = weight.dtype
        stacked = torch.zeros(out_features + num_columns, in_features, dtype=dtype, device=weight.device)
        stacked[:out_features].copy_(weight)
        base.weight = nn.Parameter(stacked[:out_features], requires_grad=False)
        self.register_buffer("stacked_weight", stacked, persistent=False)
        self.lora_a = stacked[out_features:]  # [slots * width, in]
        # a column-parallel base's bias rides on the same product (a row-parallel one's is added
        # after the all-reduce)
        bias = None
        if base.bias is not None and not self.is_row_parallel:
            bias = torch.cat([base.bias.data, base.bias.new_zeros(num_columns)])
        self.register_buffer("stacked_bias", bias, persistent=False)
        lora_bt = torch.zeros(num_columns, out_features, dtype=dtype, device=weight.device)
        self.register_buffer("lora_bt", lora_bt, persistent=False)  # [slots * width, out]
        # column of the shrink -> its slot
        self.register_buffer("column_slots", torch.arange(num_columns, device=weight.device) // width,
                             persistent=False)
        self.active = [False] * num_slots  # slot -> whether any sub-projection has a delta there

    def takes_fp8_input(self, x: torch.Tensor) -> bool:
        return False  # the deltas need x itself, not its e4m3 rows

    def load_slot(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None],
                  scaling: float) -> None:
        """Fill `slot` with one (A [rank, in], B [out, rank]) per sub-projection, whole as the
        file has them, on the host or this device (None: no delta there); this rank keeps its
        slices, B times `scaling`."""
        rows = slice(slot * self.width, (slot + 1) * self.width)
        a_slot, bt_slot = self.lora_a[rows], self.lora_bt[rows]
        a_slot.zero_()
        bt_slot.zero_()
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
            bt_rows = bt_slot[cols, sub.out_offset : sub.out_offset + size]
            if b.device == bt_rows.device:
                torch.mul(b[start : start + size].t(), scaling, out=bt_rows)
            else:
                bt_rows.copy_(b[start : start + size].t() * scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in (this rank's)] -> [num_tokens, out (this rank's)]
        product = F.linear(x, self.stacked_weight, self.stacked_bias)  # [n, out + slots * width]
        y, shrink = product[:, : self.out_features], product[:, self.out_features :]
        y = self._add_dense(shrink, y) if self.batch.use_dense else self._add_segments(shrink, y)
        if self.is_row_parallel:
            y = self.base.tp.all_reduce(y)
            if self.base.bias is not None:
                y = y + self.base.bias
        return y

    def _add_segments(self, shrink: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Each slot group's rows: its columns of the shrink times its rows of B^T."""
        y = y.contiguous()  # a new tensor when y is a column slice of the stacked product
        for group in self.batch.groups:
            if not self.active[group.slot]:
                continue
            rows = group.rows
            columns = slice(group.slot * self.width, (group.slot + 1) * self.width)
            if isinstance(rows, slice):
                y[rows] += shrink[rows, columns] @ self.lora_bt[columns]
            else:
                y.index_add_(0, rows, shrink.index_select(0, rows)[:, columns] @ self.lora_bt[columns])
        return y

    def _add_dense(self, shrink: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Every row keeping its own slot's columns of the shrink, then B^T: fixed shapes and no
        host decision, so a CUDA graph replays it for any mix of adapters."""
        slots = self.batch.token_slots[: y.shape[0]]  # [n]
        if triton_import.is_available(y):
            return triton_lora.expand_lora(shrink, y, self.lora_bt, slots, self.width)
        masked = shrink.masked_fill(self.column_slots != slots[:, None], 0)
        return torch.addmm(y, masked, self.lora_bt)  # y + masked @ B^T, a new tensor
