"""CUDA graphs of decode-only steps: the model forward plus the LM head, one graph per
batch size, replayed with no kernel-launch or Python overhead.

A decode-only step of n sequences runs the graph of the smallest captured size >= n. The
graphs read fixed device buffers (token ids, positions, slot mapping, context lengths, and
block tables of max_model_len / block_size columns), which each step fills from one upload through
the runner's pinned staging ring: the block tables and the slot mapping are gathered on the device
from the runner's persistent tables (workers/device_block_tables.py), which the upload only
updates with what changed. Rows n..size-1 are padding that must do no harm: they write their
K/V into a scratch block that the scheduler never hands out (the runner allocates one block
more than it reports) and attend over that block alone (context length 1). The Triton attention
kernel takes its loop bound from the context lengths only, so the fixed table width costs
nothing. Sampling stays outside the graph.

Under pipeline parallelism a stage's graph covers its own layers: a stage after the first
reads the previous stage's activation from a static input buffer, and a stage before the last
writes its activation (not logits) to the output buffer; the sends and receives between stages
happen outside the graph.

Everything else (steps with a prefill chunk, batches above the largest size, CPU) runs
eagerly. All ranks of a TP group capture the same sizes in the same order, and pick graph or
eager from the batch alone, so their collectives always line up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from shared.config import EngineConfig
from shared.step import SequenceWork
from workers.attention_metadata import AttentionMetadata
from workers.device_block_tables import DeviceBlockTables
from workers.host_staging import HostStaging
from workers.layers import triton_attention
from workers.pipeline import SINGLE_STAGE
from workers.step_inputs import num_blocks_of, rope_positions


def use_cuda_graphs(config: EngineConfig, device: torch.device) -> bool:
    """Decode graphs run only on CUDA, with the Triton attention kernel, when the config asks."""
    return (config.cuda_graphs and config.cuda_graph_max_batch_size > 0 and device.type == "cuda"
            and triton_attention.triton is not None)


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to max_batch_size (always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch_size] + list(range(8, max_batch_size, 8))
    return sizes + [max_batch_size]


def capture_graphs(sizes: list[int], forward, device: torch.device) -> dict[int, torch.cuda.CUDAGraph]:
    """One graph of `forward(size)` per size, largest first, all in one memory pool (only one
    runs at a time). The first call, outside any graph, allocates the output buffers that every
    graph writes."""
    forward(sizes[-1])
    torch.cuda.synchronize(device)
    graphs: dict[int, torch.cuda.CUDAGraph] = {}  # size -> its graph
    pool = None
    for size in reversed(sizes):
        forward(size)  # warm-up: Triton compile, cuBLAS plans for this shape
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a NCCL watchdog thread polling its events must not break the capture.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            forward(size)
        pool = graph.pool() if pool is None else pool
        graphs[size] = graph
    torch.cuda.synchronize(device)
    return graphs


def release(owner: object, graphs: dict[int, torch.cuda.CUDAGraph], buffers: list[str]) -> None:
    """Reset every graph (its pool goes back once the last graph sharing it is reset) and drop
    what the graphs point into: the model, the KV cache, the static inputs and outputs."""
    for graph in graphs.values():
        graph.reset()
    graphs.clear()
    for name in ["model", "kv_caches", "out", "hidden_in", "token_ids", "positions", "slot_mapping",
                 "query_start_loc", "block_tables", *buffers]:
        setattr(owner, name, None)


class GraphSet:
    """What the decode and the mixed-step graphs share: `sizes` captured largest first into one
    memory pool by `_forward(size)`, whose result goes into one output buffer for every size."""

    sizes: list[int]
    device: torch.device
    kv_caches: torch.Tensor  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    scratch_block: int  # the block padding rows write into
    out: torch.Tensor | None
    graphs: dict[int, torch.cuda.CUDAGraph]

    def _forward(self, size: int) -> torch.Tensor:
        raise NotImplementedError

    def _keep(self, value: torch.Tensor, size: int) -> torch.Tensor:
        """`value` ([size, width]) in the output buffer, sized for the largest graph at first use."""
        if self.out is None:
            self.out = torch.empty((self.sizes[-1], value.shape[-1]), dtype=value.dtype, device=value.device)
        self.out[:size].copy_(value)
        return self.out[:size]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all in one memory pool (only one runs at a time)."""
        self.graphs = capture_graphs(self.sizes, self._forward, self.device)
        # The capture's forwards ran on the static buffers' dummy inputs, whose rows may belong to
        # no sequence (the mixed graphs' empty slots): their attention output was whatever memory
        # held, NaN at times, and their K/V went into the scratch block. A decode's padded table
        # reads that block (masked on the CPU path, but 0 * NaN is NaN), so it starts clean.
        self.kv_caches[:, :, self.scratch_block].zero_()


class DecodeGraphs(GraphSet):
    def __init__(
        self, model: nn.Module, kv_caches: torch.Tensor, *, block_size: int, max_model_len: int,
        scratch_block: int, max_batch_size: int, device: torch.device, dtype: torch.dtype | None = None,
        tables: DeviceBlockTables | None = None, staging: HostStaging | None = None,
    ) -> None:
        """dtype: the activations' (None: the KV cache's, which differs under an fp8 KV cache);
        tables, staging: the runner's (None: the graphs' own)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.sizes = capture_sizes(max_batch_size)
        self.max_blocks = -(-max_model_len // block_size)  # block-table columns
        self.device = device
        size = self.sizes[-1]
        self.tables = tables or DeviceBlockTables(size, self.max_blocks, scratch_block, device)
        if self.tables.max_blocks != self.max_blocks:
            raise ValueError(f"tables of {self.tables.max_blocks} columns; the graphs read {self.max_blocks}")
        self.staging = staging or HostStaging(device)
        # Static inputs; every row starts as padding (token 0 at position 0 in the scratch block).
        self.token_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((size,), scratch_block * block_size, dtype=torch.long, device=device)
        self.context_lens = torch.ones(size, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.long, device=device)  # one token each
        self.block_tables = torch.full((size, self.max_blocks), scratch_block, dtype=torch.long,
                                       device=device)
        stage = getattr(model, "stage", SINGLE_STAGE)  # a whole model when it names none
        # The previous pipeline stage's activation, for a stage that does not embed tokens.
        self.hidden_in = None if stage.is_first else torch.zeros(
            size, model.cfg.hidden_size, dtype=dtype or kv_caches.dtype, device=device)
        self.makes_logits = stage.is_last
        # [size, vocab] logits (the last stage) or [size, hidden] activations, written by every graph
        self.out: torch.Tensor | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # batch size -> its graph

    # -- which steps ----------------------------------------------------------------

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a batch of num_seqs runs at; None when it is too big."""
        for size in self.sizes:
            if size >= num_seqs:
                return size
        return None

    def can_run(self, works: list[SequenceWork]) -> bool:
        """Decode-only, every row sampled, small enough, and within the table's columns."""
        if not works or len(works) > self.sizes[-1]:
            return False
        limit = self.max_blocks * self.block_size
        return all(len(w.token_ids) == 1 and w.is_sampled and w.start_pos < limit for w in works)

    # -- capture and replay -----------------------------------------------------------

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], num_decode_tokens=size,
            block_tables=self.block_tables[:size], seq_lens=self.context_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1], max_query_len=1, prefills=[],
            block_size=self.block_size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        # -> logits [size, vocab] or the stage's activation, written into self.out so that one
        # buffer serves every size
        hidden_in = None if self.hidden_in is None else self.hidden_in[:size]
        hidden = self.model(self.token_ids[:size], self.positions[:size], self.kv_caches, self._meta(size),
                            hidden_in)
        return self._keep(self.model.compute_logits(hidden) if self.makes_logits else hidden, size)

    @torch.inference_mode()
    def run(self, works: list[SequenceWork], hidden_in: torch.Tensor | None = None,
            fill_tokens: Callable[[torch.Tensor], None] | None = None,
            freed_req_ids: Sequence[str] = ()) -> torch.Tensor:
        """Logits [len(works), vocab] of a decode-only batch (check can_run first); on a stage
        before the last, its activation [len(works), hidden]. `hidden_in`: the previous stage's.
        `fill_tokens` writes the pending input tokens into the token-id buffer (on the device).
        `freed_req_ids`: the batch's (their block-table rows go back)."""
        num_seqs = len(works)
        size = self.padded_size(num_seqs)
        self._load_inputs(works, size, freed_req_ids)
        if fill_tokens is not None:
            fill_tokens(self.token_ids)
        if hidden_in is not None:
            self.hidden_in[:num_seqs].copy_(hidden_in)
        if self.graphs:
            self.graphs[size].replay()
        else:  # not captured (CPU tests): the same forward over the same buffers, eagerly
            self._forward(size)
        return self.out[:num_seqs]

    def close(self) -> None:
        """Destroy every graph and drop the buffers, the model and the KV cache. The graphs'
        private memory pool goes back to the caching allocator once the last graph sharing it
        is reset (then `torch.cuda.empty_cache()` can return it to the driver). Idempotent."""
        release(self, self.graphs, ["context_lens", "tables", "staging"])


    def _load_inputs(self, works: list[SequenceWork], size: int, freed_req_ids: Sequence[str] = ()) -> None:
        """Fill rows [0, size) of the static buffers; rows past len(works) become padding: token 0
        at position 0, over the pad row of the tables (the scratch block)."""
        num_seqs = len(works)
        bs, mb = self.block_size, self.max_blocks
        token_ids = np.zeros(size, dtype=np.int64)
        positions = np.zeros(size, dtype=np.int64)
        token_ids[:num_seqs] = [w.token_ids[0] for w in works]
        positions[:num_seqs] = [w.start_pos for w in works]
        context_lens = positions + 1
        num_blocks = num_blocks_of(works, mb)
        uncovered = np.flatnonzero(num_blocks <= positions[:num_seqs] // bs)
        if len(uncovered):
            bad = works[int(uncovered[0])]
            raise ValueError(f"{bad.req_id}: its block table does not cover position {bad.start_pos}")
        plan = self.tables.plan(works, freed_req_ids)
        rows = np.full(size, self.tables.pad_row, dtype=np.int64)
        rows[:num_seqs] = plan.rows
        table_index = rows * mb + positions // bs  # padding: the pad row's first entry

        parts = [token_ids, rope_positions(works, positions), context_lens, positions % bs, table_index, rows,
                 plan.diff_index, plan.diff_blocks]
        fields = torch.split(self.staging.upload(np.concatenate(parts)), [len(p) for p in parts])
        d_tokens, d_positions, d_lens, d_offsets, d_table_index, d_rows, d_diff_index, d_diff_blocks = fields
        self.token_ids[:size].copy_(d_tokens)
        self.positions[:size].copy_(d_positions)
        self.context_lens[:size].copy_(d_lens)
        self.tables.apply(d_diff_index, d_diff_blocks)
        self.tables.slots(d_table_index, d_offsets, bs, out=self.slot_mapping[:size])
        torch.index_select(self.tables.table, 0, d_rows, out=self.block_tables[:size])
