"""Turns a StepBatch into the tensors one forward pass needs.

Built with numpy, not per-token Python loops, and uploaded as ONE int64 array through the runner's
pinned staging ring (workers/host_staging.py; zero-copy on CPU), after which every field is a view
of it. Block tables are not uploaded: the runner keeps them on the device (workers/
device_block_tables.py) and the step sends only its rows and what changed; the step's table and
its slot mapping are gathers from there.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from shared.step import SequenceWork, StepBatch
from workers.attention_metadata import AttentionMetadata, PrefillChunk
from workers.device_block_tables import DeviceBlockTables
from workers.host_staging import HostStaging


@dataclass
class StepInputs:
    token_ids: torch.Tensor  # [num_tokens] long
    positions: torch.Tensor  # [num_tokens] long
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampled] long: row of each sampled work's last token
    sampled_works: list[SequenceWork]  # in the batch's order


def flat_ids(id_lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(all ids concatenated, length of each list, offset of each list in the concatenation)."""
    lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
    total = int(lengths.sum())
    flat = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int64, count=total)
    return flat, lengths, np.cumsum(lengths) - lengths


def num_blocks_of(works: list[SequenceWork], max_blocks: int) -> np.ndarray:
    """[len(works)]: the blocks each work's table names (at most max_blocks: the table's columns)."""
    counts = np.fromiter((len(w.block_ids) for w in works), dtype=np.int64, count=len(works))
    return np.minimum(counts, max_blocks)


def check_covered(works: list[SequenceWork], block_index: np.ndarray, num_blocks: np.ndarray,
                  row_starts: np.ndarray, lens: np.ndarray) -> None:
    """Raise ValueError naming the first work whose block table misses one of its tokens' blocks
    (else the lookup would read another sequence's blocks, or the pad)."""
    uncovered = np.flatnonzero(block_index >= np.repeat(num_blocks, lens))
    if len(uncovered):
        bad = works[int(np.searchsorted(row_starts, uncovered[0], side="right")) - 1]
        raise ValueError(f"{bad.req_id}: its block table does not cover the positions of this step")


def rope_positions(works: list[SequenceWork], positions: np.ndarray,
                   lens: np.ndarray | None = None) -> np.ndarray:
    """What the model gets as positions: each token's position plus its sequence's rope_offset
    (SequenceWork says why; the KV slots are computed from the plain positions)."""
    offsets = np.fromiter((w.rope_offset for w in works), dtype=np.int64, count=len(works))
    if not offsets.any():
        return positions
    per_token = offsets if lens is None else np.repeat(offsets, lens)
    out = positions.copy()
    out[: len(per_token)] += per_token
    return out


def one_off_tables(works: list[SequenceWork], block_size: int, device: torch.device) -> DeviceBlockTables:
    """Tables for a step built outside a runner (tests, scripts): every entry is a diff."""
    seq_lens = [w.start_pos + len(w.token_ids) for w in works]
    width = max([-(-n // block_size) for n in seq_lens], default=1)
    return DeviceBlockTables(max(len(works), 1), max(width, 1), pad_block=0, device=device)


def eager_order(works: list[SequenceWork]) -> list[int]:
    """The eager step's row order, as indices into `works`: the one-token works (decodes) first,
    then the others, each in batch order. Whatever reads the eager step's hidden states by work
    (prompt logprobs) walks them in this order."""
    is_decode = [len(w.token_ids) == 1 for w in works]
    return [i for i, d in enumerate(is_decode) if d] + [i for i, d in enumerate(is_decode) if not d]


def build_step_inputs(batch: StepBatch, block_size: int, device: torch.device,
                      tables: DeviceBlockTables | None = None,
                      staging: HostStaging | None = None) -> StepInputs:
    """The eager step's inputs. `tables`, `staging`: the runner's (None: one-off ones)."""
    works = batch.works
    order = eager_order(works)
    ordered = [works[i] for i in order]
    num_decodes = sum(len(w.token_ids) == 1 for w in works)
    tables = tables or one_off_tables(ordered, block_size, device)
    staging = staging or HostStaging(device, num_buffers=1)  # one step: one buffer
    mb = tables.max_blocks

    token_ids, lens, row_starts = flat_ids([w.token_ids for w in ordered])
    starts = np.fromiter((w.start_pos for w in ordered), dtype=np.int64, count=len(ordered))
    # Token t of work i sits at position start_pos_i + (t - row_start_i).
    positions = np.arange(len(token_ids), dtype=np.int64) + np.repeat(starts - row_starts, lens)
    block_index = positions // block_size
    check_covered(ordered, block_index, num_blocks_of(ordered, mb), row_starts, lens)
    plan = tables.plan(ordered, batch.freed_req_ids)
    table_index = np.repeat(plan.rows * mb, lens) + block_index  # each token's entry of the table

    last_rows = np.empty(len(works), dtype=np.int64)
    last_rows[order] = row_starts + lens - 1  # indexed by the work's place in the batch
    sampled = [i for i, w in enumerate(works) if w.is_sampled]
    sample_rows = last_rows[sampled]

    # Every sequence's table, truncated to the blocks its context needs (the decodes' rows
    # first); entries past a sequence's blocks are never read (they stop at seq_lens).
    seq_lens = starts + lens
    needed = -(-seq_lens // block_size)
    width = int(needed.max()) if len(ordered) else 0
    query_start = np.concatenate([[0], np.cumsum(lens)])

    parts = [token_ids, rope_positions(ordered, positions, lens), table_index, positions % block_size,
             sample_rows, seq_lens, query_start, plan.rows, plan.diff_index, plan.diff_blocks]
    fields = torch.split(staging.upload(np.concatenate(parts)), [len(p) for p in parts])
    (d_token_ids, d_positions, d_table_index, d_offsets, d_sample_rows, d_seq_lens, d_query_start, d_rows,
     d_diff_index, d_diff_blocks) = fields
    tables.apply(d_diff_index, d_diff_blocks)
    d_tables = tables.gather(d_rows, width)  # [num_seqs, width]

    meta = AttentionMetadata(
        slot_mapping=tables.slots(d_table_index, d_offsets, block_size),
        num_decode_tokens=num_decodes,
        block_tables=d_tables,
        seq_lens=d_seq_lens,
        query_start_loc=d_query_start,
        max_query_len=int(lens.max()) if len(ordered) else 0,
        prefills=_prefill_chunks(row_starts, lens, starts, needed, num_decodes, d_tables),
        block_size=block_size,
    )
    if num_decodes and device.type != "cuda":
        meta.decode_host = [
            (_blocks_selector(ordered[i].block_ids[: int(needed[i])]), int(seq_lens[i]))
            for i in range(num_decodes)
        ]
    return StepInputs(d_token_ids, d_positions, meta, d_sample_rows, [works[i] for i in sampled])


def _prefill_chunks(
    row_starts: np.ndarray, lens: np.ndarray, starts: np.ndarray, needed: np.ndarray, num_decodes: int,
    tables: torch.Tensor,
) -> list[PrefillChunk]:
    """One chunk per work after the decodes; each block table a view of its row of `tables`,
    the blocks its context needs."""
    return [PrefillChunk(int(row_starts[i]), int(lens[i]), int(starts[i]), tables[i, : int(needed[i])])
            for i in range(num_decodes, len(lens))]


def _blocks_selector(block_ids: list[int]) -> slice | torch.Tensor:
    """A slice (a view, no copy) when the blocks are consecutive, else an index tensor."""
    first = block_ids[0]
    if block_ids == list(range(first, first + len(block_ids))):
        return slice(first, first + len(block_ids))
    return torch.tensor(block_ids)
