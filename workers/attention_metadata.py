"""Per-step attention inputs, built once by the runner and shared by every layer.

Tokens of a step are laid out decode-first: the single tokens of decoding sequences,
then the prefill chunks one after another. Every tensor here is already on the device
when the forward starts, so no layer needs the host (no .item(), no .tolist()).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillChunk:
    token_start: int  # first row of this chunk in the step's flattened tokens
    num_tokens: int
    start_pos: int  # tokens of this sequence already in the KV cache
    block_table: torch.Tensor  # [ceil((start_pos + num_tokens) / block_size)] long: the blocks it reads


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: block_id * block_size + offset
    num_decode_tokens: int  # the first rows, one token per decoding sequence
    # Every sequence of the step, decodes first (what the CUDA kernel reads):
    block_tables: torch.Tensor  # [num_seqs, width] long; entries past a sequence's blocks are never read
    seq_lens: torch.Tensor  # [num_seqs] long: tokens cached before the step + this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] long: sequence s owns rows [start[s], start[s+1])
    max_query_len: int  # 1: a decode-only step
    prefills: list[PrefillChunk]  # the CPU path attends chunk by chunk
    block_size: int
    # CPU decode path only: per decoding sequence, (its blocks as a slice when they are
    # consecutive, else as an index tensor; its context length), so each sequence reads
    # just its own blocks.
    decode_host: list[tuple[slice | torch.Tensor, int]] | None = None
    # Mixed-step CUDA graphs (workers/mixed_graphs.py): sequences sit in fixed slots, decodes in
    # the first num_decode_slots, prefill chunks after them, empty slots with no query rows; the
    # Triton path then reads nothing above but tensors. None: the packed layout above.
    num_decode_slots: int | None = None

    @property
    def decode_block_tables(self) -> torch.Tensor:  # [num_decodes, width]
        return self.block_tables[: self.num_decode_tokens]

    @property
    def decode_context_lens(self) -> torch.Tensor:  # [num_decodes] long
        return self.seq_lens[: self.num_decode_tokens]
