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
    block_table: torch.Tensor  # [num_blocks_of_seq] long, on the device


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: block_id * block_size + offset
    num_decode_tokens: int  # the first rows, one token per decoding sequence
    # Decoding sequences as one padded batch (None when there is none):
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32 (incl. the new token)
    # [num_decodes, 1, 1, max_blocks * block_size] bool, for the PyTorch decode path; None:
    # that path derives it from decode_context_lens (CUDA-graph steps leave it out).
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]
    block_size: int
    # CPU decode path only: per decoding sequence, (its blocks as a slice when they are
    # consecutive, else as an index tensor; its context length), so each sequence reads
    # just its own blocks.
    decode_host: list[tuple[slice | torch.Tensor, int]] | None = None
