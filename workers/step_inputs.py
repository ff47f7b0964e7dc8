"""Turns a StepBatch into the tensors one forward pass needs.

Built with numpy, not per-token Python loops, and uploaded as ONE int64 array: on CUDA a
single pinned, non-blocking host-to-device copy, after which every field is a view of it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from shared.step import SequenceWork, StepBatch
from workers.attention_metadata import AttentionMetadata, PrefillChunk


@dataclass
class StepInputs:
    token_ids: torch.Tensor  # [num_tokens] long
    positions: torch.Tensor  # [num_tokens] long
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampled] long: row of each sampled work's last token
    sampled_works: list[SequenceWork]  # in the batch's order


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """One int64 host array onto the device: pinned and non-blocking on CUDA, zero-copy on CPU."""
    host = torch.from_numpy(array)
    if device.type != "cuda":
        return host
    # pin_memory() draws from PyTorch's caching host allocator, which keeps the block until
    # the copy that reads it has run, so the next step cannot overwrite it in flight.
    return host.pin_memory().to(device, non_blocking=True)


def flat_ids(id_lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(all ids concatenated, length of each list, offset of each list in the concatenation)."""
    lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
    total = int(lengths.sum())
    flat = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int64, count=total)
    return flat, lengths, np.cumsum(lengths) - lengths


def pad_block_tables(
    flat_blocks: np.ndarray, offsets: np.ndarray, num_blocks: np.ndarray, width: int, pad: int
) -> np.ndarray:
    """Rows of a padded block table [num_seqs, width]: row i holds blocks
    flat_blocks[offsets[i] : offsets[i] + num_blocks[i]] (truncated to `width`), then `pad`."""
    cols = np.arange(width, dtype=np.int64)
    index = np.minimum(offsets[:, None] + cols[None, :], max(len(flat_blocks) - 1, 0))
    values = flat_blocks[index] if len(flat_blocks) else np.zeros_like(index)
    return np.where(cols[None, :] < num_blocks[:, None], values, pad)


def build_step_inputs(batch: StepBatch, block_size: int, device: torch.device) -> StepInputs:
    works = batch.works
    is_decode = [len(w.token_ids) == 1 for w in works]
    order = [i for i, d in enumerate(is_decode) if d] + [i for i, d in enumerate(is_decode) if not d]
    ordered = [works[i] for i in order]
    num_decodes = sum(is_decode)

    token_ids, lens, row_starts = flat_ids([w.token_ids for w in ordered])
    starts = np.fromiter((w.start_pos for w in ordered), dtype=np.int64, count=len(ordered))
    # Token t of work i sits at position start_pos_i + (t - row_start_i).
    positions = np.arange(len(token_ids), dtype=np.int64) + np.repeat(starts - row_starts, lens)
    blocks, num_blocks, block_starts = flat_ids([w.block_ids for w in ordered])
    block_index = positions // block_size
    uncovered = np.flatnonzero(block_index >= np.repeat(num_blocks, lens))
    if len(uncovered):  # else the lookup below would read another sequence's blocks
        bad = ordered[int(np.searchsorted(row_starts, uncovered[0], side="right")) - 1]
        raise ValueError(f"{bad.req_id}: its block table does not cover the positions of this step")
    slots = blocks[np.repeat(block_starts, lens) + block_index] * block_size + positions % block_size

    last_rows = np.empty(len(works), dtype=np.int64)
    last_rows[order] = row_starts + lens - 1  # indexed by the work's place in the batch
    sampled = [i for i, w in enumerate(works) if w.is_sampled]
    sample_rows = last_rows[sampled]

    # Every sequence's table, truncated to the blocks its context needs (the decodes' rows
    # first); padding entries point at block 0, which no kernel reads past seq_lens.
    seq_lens = starts + lens
    needed = -(-seq_lens // block_size)
    width = int(needed.max()) if len(ordered) else 0
    tables = pad_block_tables(blocks, block_starts, needed, width, pad=0)
    query_start = np.concatenate([[0], np.cumsum(lens)])
    prefill_blocks = blocks[int(block_starts[num_decodes]):] if num_decodes < len(ordered) else blocks[:0]

    parts = [token_ids, positions, slots, sample_rows, tables.reshape(-1), seq_lens, query_start,
             prefill_blocks]
    fields = torch.split(upload(np.concatenate(parts), device), [len(p) for p in parts])
    (d_token_ids, d_positions, d_slots, d_sample_rows, d_tables, d_seq_lens, d_query_start,
     d_prefill_blocks) = fields

    meta = AttentionMetadata(
        slot_mapping=d_slots,
        num_decode_tokens=num_decodes,
        block_tables=d_tables.view(len(ordered), width),
        seq_lens=d_seq_lens,
        query_start_loc=d_query_start,
        max_query_len=int(lens.max()) if len(ordered) else 0,
        prefills=_prefill_chunks(row_starts, lens, starts, num_blocks, num_decodes, d_prefill_blocks),
        block_size=block_size,
    )
    if num_decodes and device.type != "cuda":
        meta.decode_host = [
            (_blocks_selector(ordered[i].block_ids[: int(needed[i])]), int(seq_lens[i]))
            for i in range(num_decodes)
        ]
    return StepInputs(d_token_ids, d_positions, meta, d_sample_rows, [works[i] for i in sampled])


def _prefill_chunks(
    row_starts: np.ndarray, lens: np.ndarray, starts: np.ndarray, num_blocks: np.ndarray, num_decodes: int,
    prefill_blocks: torch.Tensor,
) -> list[PrefillChunk]:
    """One chunk per work after the decodes; each block table a view of `prefill_blocks`."""
    chunks = []
    offset = 0
    for i in range(num_decodes, len(lens)):
        n = int(num_blocks[i])
        chunks.append(PrefillChunk(int(row_starts[i]), int(lens[i]), int(starts[i]),
                                   prefill_blocks[offset : offset + n]))
        offset += n
    return chunks


def _blocks_selector(block_ids: list[int]) -> slice | torch.Tensor:
    """A slice (a view, no copy) when the blocks are consecutive, else an index tensor."""
    first = block_ids[0]
    if block_ids == list(range(first, first + len(block_ids))):
        return slice(first, first + len(block_ids))
    return torch.tensor(block_ids)
