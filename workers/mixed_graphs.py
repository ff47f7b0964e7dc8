"""CUDA graphs of mixed steps (decodes plus prefill chunks): the model body, one graph per
token-count bucket, replayed with no kernel-launch or Python overhead.

Under steady arrivals almost every step mixes a few prefill chunks with the running decodes, and
launching such a step eagerly costs the host more than the GPU spends on it (about 400 kernel
launches for a 32-layer model). A graph replays a fixed sequence of launches with fixed grids,
so the step is laid out in fixed places:
- tokens: the decodes' single tokens first, then the prefill chunks' tokens, padded to the
  bucket's size; a padding row writes its K/V into the scratch block and belongs to no sequence;
- sequences: `num_decode_slots` slots for decodes (max_num_seqs: every running sequence fits),
  then `num_prefill_slots` for prefill chunks; an unused slot has no query rows and its
  attention programs exit at once (`triton_attention.paged_attention_slots`).
So the attention grids depend on the bucket alone, and one graph serves every step whose
tokens fit its bucket, whatever the split between decodes and prefills.

The graph ends at the model's last hidden states; the LM head runs eagerly on the sampled rows
only (a handful of launches), so padding costs no vocabulary-sized product. Steps above the
largest bucket, or with more prefill chunks than slots, run eagerly: they are GPU-bound anyway.
A pure-decode step takes the decode graphs (`workers/cuda_graphs.py`), which split long contexts
over several programs. All ranks of a group choose from the batch alone, as there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from shared.step import SequenceWork
from workers.attention_metadata import AttentionMetadata, PrefillChunk
from workers.cuda_graphs import GraphSet, release
from workers.device_block_tables import DeviceBlockTables
from workers.host_staging import HostStaging
from workers.layers import triton_attention
from workers.pipeline import SINGLE_STAGE
from workers.step_inputs import check_covered, flat_ids, num_blocks_of, rope_positions

MAX_PREFILL_SLOTS = 32  # prefill chunks one graph step takes; a step with more runs eagerly


def token_buckets(max_tokens: int) -> list[int]:
    """Every multiple of 16 to 256, of 32 to 512, of 64 to 1,024, of 128 to 2,048 (the step
    doubling with the range), up to max_tokens (always included): above 128 tokens less than
    1/8 of a step is padding."""
    sizes, size, step = [], 16, 16
    while size < max_tokens:
        sizes.append(size)
        if size >= 16 * step:
            step *= 2
        size = size + step if size > 16 else 32
    return sizes + [max_tokens]


class MixedGraphs(GraphSet):
    def __init__(
        self, model: nn.Module, kv_caches: torch.Tensor, *, block_size: int, max_model_len: int,
        scratch_block: int, max_tokens: int, num_decode_slots: int, hidden_size: int,
        device: torch.device, num_prefill_slots: int = MAX_PREFILL_SLOTS, dtype: torch.dtype | None = None,
        tables: DeviceBlockTables | None = None, staging: HostStaging | None = None,
    ) -> None:
        """dtype: the activations' (None: the KV cache's, which differs under an fp8 KV cache);
        tables, staging: the runner's (None: the graphs' own)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_model_len = max_model_len
        self.sizes = token_buckets(max_tokens)
        self.num_decode_slots = num_decode_slots
        self.num_prefill_slots = num_prefill_slots
        self.device = device
        num_slots = num_decode_slots + num_prefill_slots
        max_blocks = -(-max_model_len // block_size)  # block-table columns
        size = self.sizes[-1]
        # Static inputs every graph reads; _load_inputs rewrites the rows a step uses.
        self.token_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((size,), scratch_block * block_size, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(num_slots, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(num_slots + 1, dtype=torch.long, device=device)
        self.block_tables = torch.full((num_slots, max_blocks), scratch_block, dtype=torch.long,
                                       device=device)
        self.tables = tables or DeviceBlockTables(num_slots, max_blocks, scratch_block, device)
        if self.tables.max_blocks != max_blocks:
            raise ValueError(f"tables of {self.tables.max_blocks} columns; the graphs read {max_blocks}")
        self.staging = staging or HostStaging(device)
        stage = getattr(model, "stage", SINGLE_STAGE)
        self.hidden_in = None if stage.is_first else torch.zeros(
            size, hidden_size, dtype=dtype or kv_caches.dtype, device=device)
        self.out: torch.Tensor | None = None  # [size, hidden]: the model body's output, every graph's
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # token bucket -> its graph
        # The eager stand-in's attention inputs (no Triton: CPU tests), set by _load_inputs.
        self._host_meta: AttentionMetadata | None = None

    # -- which steps ----------------------------------------------------------------

    def bucket(self, num_tokens: int) -> int | None:
        for size in self.sizes:
            if size >= num_tokens:
                return size
        return None

    def can_run(self, works: list[SequenceWork]) -> bool:
        """A step with prefill rows that fits a bucket and the slots, within the table's columns."""
        num_prefills = sum(len(w.token_ids) > 1 for w in works)
        if not num_prefills or num_prefills > self.num_prefill_slots:
            return False
        if len(works) - num_prefills > self.num_decode_slots:
            return False
        if self.bucket(sum(len(w.token_ids) for w in works)) is None:
            return False
        return all(w.start_pos + len(w.token_ids) <= self.max_model_len for w in works)

    # -- capture and replay -----------------------------------------------------------

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], num_decode_tokens=0, block_tables=self.block_tables,
            seq_lens=self.seq_lens, query_start_loc=self.query_start_loc, max_query_len=size, prefills=[],
            block_size=self.block_size, num_decode_slots=self.num_decode_slots,
        )

    def _forward(self, size: int) -> torch.Tensor:
        meta = self._meta(size) if self._host_meta is None else self._host_meta
        hidden_in = None if self.hidden_in is None else self.hidden_in[:size]
        hidden = self.model(self.token_ids[:size], self.positions[:size], self.kv_caches, meta, hidden_in)
        return self._keep(hidden, size)

    @torch.inference_mode()
    def run(self, works: list[SequenceWork], hidden_in: torch.Tensor | None = None,
            fill_tokens: Callable[[torch.Tensor], None] | None = None,
            freed_req_ids: Sequence[str] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """(the body's output for the step's rows [num_tokens, hidden], decodes first then the
        chunks in batch order; the row of each sampled work's last token, in batch order).
        Check can_run first. `hidden_in`: the previous pipeline stage's activation, same rows.
        `fill_tokens` writes the pending input tokens into the token-id buffer (on the device).
        `freed_req_ids`: the batch's (their block-table rows go back)."""
        num_tokens = sum(len(w.token_ids) for w in works)
        size = self.bucket(num_tokens)
        sample_rows = self._load_inputs(works, size, freed_req_ids)
        if fill_tokens is not None:
            fill_tokens(self.token_ids)
        if hidden_in is not None:
            self.hidden_in[:num_tokens].copy_(hidden_in)
        if self.graphs:
            self.graphs[size].replay()
        else:  # not captured (CPU tests): the same forward over the same buffers, eagerly
            self._forward(size)
        return self.out[:num_tokens], sample_rows

    def close(self) -> None:
        """Destroy every graph and drop the buffers, the model and the KV cache. Idempotent."""
        release(self, self.graphs, ["seq_lens", "_host_meta", "tables", "staging"])

    # -- inputs -------------------------------------------------------------------------

    def _load_inputs(self, works: list[SequenceWork], size: int,
                     freed_req_ids: Sequence[str] = ()) -> torch.Tensor:
        """Fill the static buffers for this step (rows [0, size), every slot); returns the
        sample rows on the device."""
        bs, mb = self.block_size, self.tables.max_blocks
        is_decode = [len(w.token_ids) == 1 for w in works]
        order = [i for i, d in enumerate(is_decode) if d] + [i for i, d in enumerate(is_decode) if not d]
        ordered = [works[i] for i in order]
        num_decodes = sum(is_decode)
        num_prefills = len(works) - num_decodes

        ids, lens, row_starts = flat_ids([w.token_ids for w in ordered])
        num_tokens = len(ids)
        starts = np.fromiter((w.start_pos for w in ordered), dtype=np.int64, count=len(ordered))
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - row_starts, lens)
        check_covered(ordered, positions // bs, num_blocks_of(ordered, mb), row_starts, lens)
        plan = self.tables.plan(ordered, freed_req_ids)

        # Padding rows: token 0 at position 0, over the pad row's first entry (the scratch block).
        token_ids = np.zeros(size, dtype=np.int64)
        token_pos = np.zeros(size, dtype=np.int64)
        table_index = np.full(size, self.tables.pad_row * mb, dtype=np.int64)
        token_ids[:num_tokens] = ids
        token_pos[:num_tokens] = positions
        table_index[:num_tokens] = np.repeat(plan.rows * mb, lens) + positions // bs

        # Sequence slots: decodes in [0, num_decodes), prefills from num_decode_slots on.
        d_slots, num_slots = self.num_decode_slots, self.num_decode_slots + self.num_prefill_slots
        slot_of = np.concatenate([np.arange(num_decodes), d_slots + np.arange(num_prefills)]).astype(np.int64)
        ends = row_starts + lens
        query_start = np.empty(num_slots + 1, dtype=np.int64)
        query_start[: d_slots + 1] = num_decodes  # empty decode slots, and where the chunks begin
        query_start[:num_decodes] = np.arange(num_decodes)
        query_start[d_slots + 1:] = num_tokens  # empty prefill slots end with the tokens
        query_start[d_slots + 1: d_slots + 1 + num_prefills] = ends[num_decodes:]
        seq_lens = np.ones(num_slots, dtype=np.int64)
        seq_lens[slot_of] = starts + lens
        slot_rows = np.full(num_slots, self.tables.pad_row, dtype=np.int64)  # empty slots: the pad row
        slot_rows[slot_of] = plan.rows

        last_rows = np.empty(len(works), dtype=np.int64)
        last_rows[order] = ends - 1  # indexed by the work's place in the batch
        sample_rows = last_rows[[i for i, w in enumerate(works) if w.is_sampled]]

        parts = [token_ids, rope_positions(ordered, token_pos, lens), token_pos % bs, table_index, seq_lens,
                 query_start, slot_rows, sample_rows, plan.diff_index, plan.diff_blocks]
        fields = torch.split(self.staging.upload(np.concatenate(parts)), [len(p) for p in parts])
        (d_ids, d_pos, d_offsets, d_table_index, d_lens, d_qs, d_slot_rows, d_sample_rows, d_diff_index,
         d_diff_blocks) = fields
        self.token_ids[:size].copy_(d_ids)
        self.positions[:size].copy_(d_pos)
        self.seq_lens.copy_(d_lens)
        self.query_start_loc.copy_(d_qs)
        self.tables.apply(d_diff_index, d_diff_blocks)
        self.tables.slots(d_table_index, d_offsets, bs, out=self.slot_mapping[:size])
        torch.index_select(self.tables.table, 0, d_slot_rows, out=self.block_tables)
        if not triton_attention.is_available(self.token_ids):
            needed = -(-(starts + lens) // bs)
            self._host_meta = self._portable_meta(size, ordered, num_decodes, row_starts, lens, starts,
                                                  needed)
        return d_sample_rows

    def _portable_meta(self, size: int, ordered: list[SequenceWork], num_decodes: int, row_starts: np.ndarray,
                       lens: np.ndarray, starts: np.ndarray, needed: np.ndarray) -> AttentionMetadata:
        """The PyTorch attention path's view of the same slots (CPU tests of the eager stand-in):
        decode rows first, each prefill chunk over its slot's table row."""
        chunks = [
            PrefillChunk(int(row_starts[i]), int(lens[i]), int(starts[i]),
                         self.block_tables[self.num_decode_slots + i - num_decodes, : int(needed[i])])
            for i in range(num_decodes, len(ordered))
        ]
        num_tokens = int(lens.sum())
        if size > num_tokens:
            # The padding rows attend among themselves (a chunk with nothing cached): left out,
            # their attention output would be uninitialized memory, NaN at times, and go into the
            # scratch block's K/V, which padded block tables let decodes read (masked, 0 * NaN).
            chunks.append(PrefillChunk(num_tokens, size - num_tokens, 0, self.block_tables[0, :0]))
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], num_decode_tokens=num_decodes,
            block_tables=self.block_tables[:num_decodes], seq_lens=self.seq_lens[:num_decodes],
            query_start_loc=self.query_start_loc, max_query_len=int(lens.max()), prefills=chunks,
            block_size=self.block_size,
        )

