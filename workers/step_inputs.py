"""Turns a StepBatch into the tensors one forward pass needs."""

from __future__ import annotations

from dataclasses import dataclass

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


def build_step_inputs(batch: StepBatch, block_size: int, device: torch.device) -> StepInputs:
    decodes = [w for w in batch.works if len(w.token_ids) == 1]
    prefills = [w for w in batch.works if len(w.token_ids) > 1]
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    last_row: dict[int, int] = {}  # id(work) -> its last token's row
    chunks: list[PrefillChunk] = []
    for work in decodes + prefills:
        row = len(token_ids)
        n = len(work.token_ids)
        token_ids.extend(work.token_ids)
        for pos in range(work.start_pos, work.start_pos + n):
            positions.append(pos)
            slots.append(work.block_ids[pos // block_size] * block_size + pos % block_size)
        last_row[id(work)] = row + n - 1
        if n > 1:
            table = torch.tensor(work.block_ids, dtype=torch.long, device=device)
            chunks.append(PrefillChunk(row, n, work.start_pos, table))

    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decode_tokens=len(decodes),
        decode_block_tables=None,
        decode_context_lens=None,
        decode_mask=None,
        prefills=chunks,
        block_size=block_size,
    )
    if decodes:
        _add_decode_batch(meta, decodes, block_size, device)
    sampled = [w for w in batch.works if w.is_sampled]
    return StepInputs(
        token_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=meta,
        sample_rows=torch.tensor([last_row[id(w)] for w in sampled], dtype=torch.long, device=device),
        sampled_works=sampled,
    )


def _add_decode_batch(
    meta: AttentionMetadata, decodes: list[SequenceWork], block_size: int, device: torch.device
) -> None:
    context_lens = [w.start_pos + 1 for w in decodes]
    max_blocks = max(-(-n // block_size) for n in context_lens)
    # Padding entries point at block 0; the mask hides whatever it holds.
    tables = [w.block_ids[:max_blocks] + [0] * (max_blocks - len(w.block_ids[:max_blocks])) for w in decodes]
    meta.decode_block_tables = torch.tensor(tables, dtype=torch.long, device=device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    meta.decode_context_lens = lens
    key_pos = torch.arange(max_blocks * block_size, device=device)
    meta.decode_mask = (key_pos[None, :] < lens[:, None]).view(len(decodes), 1, 1, -1)
