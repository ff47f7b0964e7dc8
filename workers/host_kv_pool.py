"""A rank's host KV pool: copies of full KV blocks in host memory (pinned on CUDA), its own shard
of every block (its heads, its pipeline stage's layers), and the copies between it and the GPU
cache that a step carries (`StepBatch.kv_stores` / `kv_loads`; scheduler/host_tier.py decides).

Layout. The GPU cache is [layers, 2, blocks, block_size, heads, head_dim]: one block is scattered
over 2 x layers runs. The host pool is [blocks, layers, 2, block_size, heads, head_dim] (held as
[blocks, layers x 2, words]): one block is one contiguous run, so that a block crosses the link in
one copy, several adjacent slots in one copy too. Between the two layouts, a staging buffer on the
GPU: a store gathers the blocks into it in one indexing kernel and copies each run of adjacent slots
down; a load copies the runs up and scatters them into the cache in one kernel. Bytes are copied as
bytes (the widest integer view a block's rows divide into), whatever the cache's dtype (FP8
included). The block ids go up through a pinned staging ring (workers/host_staging.py), never a
freshly pinned tensor.

Streams. On CUDA the copies run on a stream of their own, after the work queued before the step
(an event on the compute stream, `mark`ed before the step's forward: a store reads what earlier
steps wrote, a load writes a block after any late write of its former owner), beside the step's
own kernels, which never wait for them, and nothing on the host waits for them either. The runner
queues them after the step's forward and sampling, so that the host's time queuing them is spent
while the device computes, not before it starts. Once the runner has finished the step (the
scheduler may then hand its copies' GPU blocks to new owners), every later kernel on the compute
stream waits for the copies on the device (`KVCopies.fence`): a GPU block is never written by
its next owner before its store has read it, and a loaded block is never read before its load has
written it. A step pays for a copy only if the copy is still running when the step's kernels
start: under async scheduling that is two steps after the copy's own (the next one is launched
before the copy's step is finished), one step after it otherwise.
Host slots need no such fence: every copy of a rank runs on its one copy stream, in order, so a
load of a slot follows the store that filled it, and a store into a slot follows the loads before
it. On a CPU the same code runs synchronously.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from workers.host_staging import HostStaging

# Blocks staged at once on the GPU (a store's gather, a load's scatter): bounds the staging
# buffer (64 blocks of an 8B model in bf16 are 128 MiB) without cutting a copy too small.
STAGING_BLOCKS = 64


# Blocks in one device-to-host copy of a store, at most. A step's own small device-to-host copy
# (its sampled ids) may queue behind a store's copy on the same copy engine; 8 blocks of an 8B
# model (16 MiB, about 0.5 ms) bound that wait and still cross at about 35 GB/s (64 blocks: about
# 40; docs/kv-offloading.md), far above what the stores need. Loads, which a request waits for,
# go in runs as long as the staging buffer.
STORE_RUN_BLOCKS = 8


def _runs(slots: list[int], max_length: int = STAGING_BLOCKS) -> list[tuple[int, int, int]]:
    """(index in `slots`, first slot, length) of each run of consecutive slots, cut at max_length."""
    runs: list[tuple[int, int, int]] = []
    for index, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot and runs[-1][2] < max_length:
            first_index, first, length = runs[-1]
            runs[-1] = (first_index, first, length + 1)
        else:
            runs.append((index, slot, 1))
    return runs


class KVCopies:
    """The copies of one step, queued on the copy stream (complete already on a CPU)."""

    def __init__(self, device: torch.device, done: torch.cuda.Event | None, started: torch.cuda.Event | None,
                 num_loads: int, cpu_load_seconds: float = 0.0) -> None:
        self._device = device
        self._done = done
        self._started = started  # recorded with timing when the copies carry loads
        self.num_loads = num_loads
        self._load_seconds = cpu_load_seconds

    def fence(self) -> None:
        """Every kernel queued on the compute stream from now on runs after these copies (on the
        device: the host goes on)."""
        if self._done is not None:
            torch.cuda.current_stream(self._device).wait_event(self._done)

    def is_done(self) -> bool:
        return self._done is None or self._done.query()

    def wait(self) -> None:
        """Return once the copies are complete (the host waits)."""
        if self._done is not None:
            self._done.synchronize()

    def load_seconds(self) -> float:
        """The copy stream's time for the step's copies when it carries loads (they dominate it),
        0.0 otherwise; once `is_done`."""
        if self._started is None or not self.num_loads:
            return self._load_seconds
        return self._started.elapsed_time(self._done) / 1000


class HostKVPool:
    def __init__(self, kv_caches: torch.Tensor, num_blocks: int) -> None:
        """`kv_caches`: the rank's GPU cache [layers, 2, blocks, block_size, heads, head_dim]."""
        self.device = kv_caches.device
        self.num_blocks = num_blocks
        layers, two, num_gpu_blocks, block_size, heads, head_dim = kv_caches.shape
        row_bytes = block_size * heads * head_dim * kv_caches.element_size()
        # A block's run of one layer's K or V as the widest integers it divides into: an indexing
        # kernel moves one element per thread, so int64 moves 8x the bytes of uint8 per thread.
        word = next(dtype for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8)
                    if row_bytes % dtype.itemsize == 0)
        # The cache as words: [layers x 2, blocks, words of one block's run].
        self._gpu = kv_caches.view(torch.uint8).view(layers * two, num_gpu_blocks, row_bytes).view(word)
        row = self._gpu.shape[-1]
        is_cuda = self.device.type == "cuda"
        self.pool = torch.empty((num_blocks, layers * two, row), dtype=word)
        # Pinned in place (cudaHostRegister), not through pin_memory=True, whose caching host
        # allocator rounds a size up to a power of two: 48 GiB asked would pin 64.
        self._is_registered = False
        if is_cuda:
            cudart = torch.cuda.cudart()
            nbytes = self.pool.numel() * self.pool.element_size()
            torch.cuda.check_error(cudart.cudaHostRegister(self.pool.data_ptr(), nbytes, 0))
            self._is_registered = True
        self.block_bytes = self.pool[0].numel() * self.pool.element_size()
        self._stream = torch.cuda.Stream(self.device) if is_cuda else None
        # [1, layers x 2]: with a column of block ids, indexes every run of those blocks at once.
        self._planes = torch.arange(layers * two, device=self.device).unsqueeze(0)
        self._staging = HostStaging(self.device)

    def mark(self) -> torch.cuda.Event | None:
        """An event behind the work queued on the compute stream so far (None on a CPU): `copy`'s
        `after`, for copies queued later that must not wait for what is queued in between."""
        return torch.cuda.current_stream(self.device).record_event() if self._stream is not None else None

    def copy(self, stores: list[tuple[int, int]], loads: list[tuple[int, int]],
             after: torch.cuda.Event | None = None) -> KVCopies | None:
        """Queue a step's copies: `stores` (GPU block, slot) to the host, then `loads` (slot, GPU
        block) to the GPU, once the compute stream has reached `after` (default: now). None when
        there are none."""
        if not stores and not loads:
            return None
        if self._stream is None:
            self._store(stores)
            start = time.perf_counter()
            self._load(loads)
            return KVCopies(self.device, None, None, len(loads), time.perf_counter() - start)
        after = after or self.mark()
        # Timing events only where a load is timed: a plain event is cheaper to record and query.
        started = torch.cuda.Event(enable_timing=True) if loads else None
        done = torch.cuda.Event(enable_timing=bool(loads))
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(after)
            if started is not None:
                started.record(self._stream)
            self._store(stores)
            self._load(loads)
            done.record(self._stream)
        return KVCopies(self.device, done, started, len(loads))

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        """[n, 1] block ids on the device (on the current stream: the copy stream on CUDA)."""
        return self._staging.upload(np.asarray(block_ids, dtype=np.int64)).unsqueeze(1)

    def _store(self, stores: list[tuple[int, int]]) -> None:
        for start in range(0, len(stores), STAGING_BLOCKS):
            chunk = stores[start:start + STAGING_BLOCKS]
            # [n, layers x 2, row]: each block one contiguous run, as on the host; one gather.
            staged = self._gpu[self._planes, self._index([block_id for block_id, _ in chunk])]
            for index, slot, length in _runs([slot for _, slot in chunk], STORE_RUN_BLOCKS):
                self.pool[slot:slot + length].copy_(staged[index:index + length], non_blocking=True)

    def _load(self, loads: list[tuple[int, int]]) -> None:
        for start in range(0, len(loads), STAGING_BLOCKS):
            chunk = loads[start:start + STAGING_BLOCKS]
            staged = torch.empty((len(chunk), *self.pool.shape[1:]), dtype=self.pool.dtype,
                                 device=self.device)
            for index, slot, length in _runs([slot for slot, _ in chunk]):
                staged[index:index + length].copy_(self.pool[slot:slot + length], non_blocking=True)
            self._gpu[self._planes, self._index([block_id for _, block_id in chunk])] = staged  # one scatter

    def close(self) -> None:
        """Give the host memory back (the runner closes)."""
        if self._stream is not None:
            with contextlib.suppress(RuntimeError):
                self._stream.synchronize()
        if self._is_registered:
            self._is_registered = False
            torch.cuda.cudart().cudaHostUnregister(self.pool.data_ptr())
        self.pool = torch.empty(0, dtype=torch.uint8)
        self._staging = None
        self._gpu = None  # a view that would keep the KV cache's storage alive
