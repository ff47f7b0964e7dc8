"""The running requests' block tables in one persistent device tensor, updated by diffs.

Every step used to upload each sequence's whole padded block table (num_seqs x width int64).
Instead each request keeps one row of `table` while it runs: assigned when the runner first sees
it, given back when the scheduler says it left for good (`StepBatch.freed_req_ids`: finished,
aborted, preempted). A step uploads only
- the rows of its sequences, in its layout's order, and
- the entries that changed since the row was last written, as (flat index, block id): usually
  none or one block per sequence; a prefix-cache hit or a resume after preemption rewrites a
  whole row, which is just a longer diff,
and on the device `apply` scatters the diff into `table`, and the step's block table is a gather of
its rows (into a graph's static buffer, or a new tensor for an eager step).

Correctness does not depend on hearing about every request that left: a row's host mirror is
compared with the work's block ids every step, so a request whose table changed unannounced gets
the difference. The frees only keep rows available; when none is, the row used least recently by
a request outside the step is taken back.

Row `pad_row` (the last) holds `pad_block` only and is never written: graph steps point their
padding sequences and tokens at it. Entries past a request's blocks hold stale or pad ids, which
no kernel reads (every read stops at the sequence's length).

All ranks (tensor and pipeline parallel) see the same batches in the same order, so their tables
stay the same; each rank's would be right on its own anyway, by the comparison above.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from shared.step import SequenceWork


@dataclass
class TablePlan:
    """What one step uploads for its block tables (host arrays, int64)."""

    rows: np.ndarray  # [num_seqs]: the row of each work, in the order the works were given
    diff_index: np.ndarray  # [num_changed]: flat index (row * max_blocks + column) into the table
    diff_blocks: np.ndarray  # [num_changed]: the block id that goes there


class DeviceBlockTables:
    def __init__(self, max_rows: int, max_blocks: int, pad_block: int, device: torch.device) -> None:
        """max_rows: requests at a time (max_num_seqs, plus some spare); max_blocks: columns
        (ceil(max_model_len / block_size)); pad_block: what unused entries hold (the scratch
        block, so that a padding row's reads and writes land there)."""
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        self.pad_row = max_rows
        self.device = device
        # [max_rows + 1, max_blocks] long: row r holds the blocks of the request _row_of names
        self.table = torch.full((max_rows + 1, max_blocks), pad_block, dtype=torch.long, device=device)
        self._row_of: dict[str, int] = {}  # req_id -> its row
        self._blocks_of: dict[str, list[int]] = {}  # req_id -> the blocks its row holds on the device
        self._last_step: dict[str, int] = {}  # req_id -> the plan() call that last used its row
        self._free_rows = list(range(max_rows - 1, -1, -1))  # popped from the end: row 0 first
        self._num_plans = 0
        self.num_evictions = 0  # rows taken back unannounced (0 while the frees arrive)

    @property
    def num_rows_in_use(self) -> int:
        return len(self._row_of)

    def row_of(self, req_id: str) -> int | None:
        return self._row_of.get(req_id)

    def release(self, req_ids: Iterable[str]) -> None:
        """Give back the rows of requests that left the batch for good (unknown ids are ignored)."""
        for req_id in req_ids:
            row = self._row_of.pop(req_id, None)
            if row is not None:
                del self._blocks_of[req_id], self._last_step[req_id]
                self._free_rows.append(row)

    def plan(self, works: list[SequenceWork], freed_req_ids: Iterable[str] = ()) -> TablePlan:
        """The rows of `works` (assigning rows to new requests) and the diff that brings them up to
        date with the works' block ids. The host mirror is updated now: the step must `apply`
        the diff before any later step's."""
        self.release(freed_req_ids)
        self._num_plans += 1
        mb, step = self.max_blocks, self._num_plans
        row_of, blocks_of, last_step = self._row_of, self._blocks_of, self._last_step
        rows: list[int] = []
        index: list[int] = []
        blocks: list[int] = []
        for work in works:  # the hot loop of a step's inputs: dict look-ups and a list compare
            req_id = work.req_id
            row = row_of.get(req_id)
            if row is None:
                row = self._assign(req_id, works)
            rows.append(row)
            last_step[req_id] = step
            new = work.block_ids
            known = blocks_of[req_id]
            if new == known:
                continue
            if len(new) > mb:  # columns past max_blocks would cover positions past max_model_len
                new = new[:mb]
            start = _common_prefix(known, new)
            base = row * mb
            index.extend(range(base + start, base + len(new)))
            blocks.extend(new[start:])
            if start == len(known):
                known.extend(new[start:])
            else:
                blocks_of[req_id] = list(new)
        return TablePlan(np.array(rows, dtype=np.int64), np.array(index, dtype=np.int64),
                         np.array(blocks, dtype=np.int64))

    def apply(self, diff_index: torch.Tensor, diff_blocks: torch.Tensor) -> None:
        """Write a plan's diff into the table (on the device, in stream order)."""
        if diff_index.numel():
            self.table.view(-1).index_copy_(0, diff_index, diff_blocks)

    def gather(self, rows: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """A new [len(rows), width] tensor of those rows' first `width` columns (None: all)."""
        table = self.table if width is None else self.table[:, :width]
        return table.index_select(0, rows)

    def slots(self, table_index: torch.Tensor, offsets: torch.Tensor, block_size: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """Slot mapping of tokens: table.flat[table_index] * block_size + offsets (each token's
        block from its row and column, and its offset in the block), on the device."""
        blocks = self.table.view(-1).index_select(0, table_index)
        return torch.add(offsets, blocks, alpha=block_size, out=out)

    def _assign(self, req_id: str, works: list[SequenceWork]) -> int:
        if not self._free_rows:
            self._evict(works)
        row = self._free_rows.pop()
        self._row_of[req_id] = row
        self._blocks_of[req_id] = []  # nothing of this request's is on the device yet
        return row

    def _evict(self, works: list[SequenceWork]) -> None:
        """Take back the row used least recently by a request that is not in this step (one whose
        leaving was not announced, or is announced late: async scheduling frees a step late)."""
        in_step = {w.req_id for w in works}
        candidates = [r for r in self._row_of if r not in in_step]
        if not candidates:
            raise RuntimeError(f"a step of {len(works)} sequences outgrows {self.max_rows} block-table rows")
        self.num_evictions += 1
        self.release([min(candidates, key=self._last_step.__getitem__)])


def _common_prefix(known: list[int], new: list[int]) -> int:
    """How many leading entries `known` and `new` share (the usual case: all of `known`)."""
    n = min(len(known), len(new))
    if known[:n] == new[:n]:
        return n
    return next(i for i in range(n) if known[i] != new[i])
