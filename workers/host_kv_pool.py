"""A rank's host KV pool: copies of full KV blocks in host memory (pinned on CUDA), its own shard
of every block (its heads, its pipeline stage's layers), and the copies between it and the GPU
cache that a step carries (`StepBatch.kv_stores` / `kv_loads`; scheduler/host_tier.py decides).

Layout. The GPU cache is [layers, 2, blocks, block_size, heads, head_dim]: one block is scattered
over 2 x layers runs. The host pool is [blocks, layers, 2, block_size, heads, head_dim]: one block
is one contiguous run, so that a block crosses the link in one copy, several adjacent slots in
one copy too. Between the two layouts, a staging buffer on the GPU: a store gathers the blocks
(index_select) into it and copies each run of adjacent slots down; a load copies the runs up and
scatters them (index_copy_) into the cache. Bytes are copied as bytes (a uint8 view), whatever
the cache's dtype (FP8 included).

Streams. On CUDA the copies run on a stream of their own, after the work queued before the step
(an event on the compute stream: a store reads what earlier steps wrote, a load writes a block
after any late write of its former owner), beside the step's own kernels, which never wait for
them. The runner waits for a step's copies when it finishes the step (`wait`), so that the
scheduler, once it has the step back, may hand their blocks out again. On a CPU the same code
runs synchronously.
"""

from __future__ import annotations

import contextlib
import time

import torch

# Blocks staged at once on the GPU (a store's gather, a load's scatter): bounds the staging
# buffer (64 blocks of an 8B model in bf16 are 128 MiB) without cutting a copy too small.
STAGING_BLOCKS = 64


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(index in `slots`, first slot, length) of each run of consecutive slots."""
    runs: list[tuple[int, int, int]] = []
    for index, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first_index, first, length = runs[-1]
            runs[-1] = (first_index, first, length + 1)
        else:
            runs.append((index, slot, 1))
    return runs


class KVCopies:
    """The copies of one step, queued; `wait` returns once they are complete."""

    def __init__(self, done: torch.cuda.Event | None, started: torch.cuda.Event | None,
                 num_loads: int, cpu_load_seconds: float = 0.0) -> None:
        self._done = done
        self._started = started
        self.num_loads = num_loads
        self.load_seconds = cpu_load_seconds

    def wait(self) -> None:
        if self._done is None:
            return
        self._done.synchronize()
        if self._started is not None and self.num_loads:
            # The whole copy stream's time for the step; loads dominate it when there are any.
            self.load_seconds = self._started.elapsed_time(self._done) / 1000
        self._done = None


class HostKVPool:
    def __init__(self, kv_caches: torch.Tensor, num_blocks: int) -> None:
        """`kv_caches`: the rank's GPU cache [layers, 2, blocks, block_size, heads, head_dim]."""
        self.device = kv_caches.device
        self.num_blocks = num_blocks
        layers, two, _, block_size, heads, head_dim = kv_caches.shape
        # The cache as bytes: [layers, 2, blocks, block_size, heads, head_dim * element size].
        self._gpu = kv_caches.view(torch.uint8)
        row = self._gpu.shape[-1]
        is_cuda = self.device.type == "cuda"
        self.pool = torch.empty((num_blocks, layers, two, block_size, heads, row), dtype=torch.uint8)
        # Pinned in place (cudaHostRegister), not through pin_memory=True, whose caching host
        # allocator rounds a size up to a power of two: 48 GiB asked would pin 64.
        self._is_registered = False
        if is_cuda:
            cudart = torch.cuda.cudart()
            torch.cuda.check_error(cudart.cudaHostRegister(self.pool.data_ptr(), self.pool.numel(), 0))
            self._is_registered = True
        self.block_bytes = self.pool[0].numel()
        self._stream = torch.cuda.Stream(self.device) if is_cuda else None

    def copy(self, stores: list[tuple[int, int]], loads: list[tuple[int, int]]) -> KVCopies | None:
        """Queue a step's copies: `stores` (GPU block, slot) to the host, then `loads` (slot, GPU
        block) to the GPU. None when there are none."""
        if not stores and not loads:
            return None
        if self._stream is None:
            self._store(stores)
            start = time.perf_counter()
            self._load(loads)
            return KVCopies(None, None, len(loads), time.perf_counter() - start)
        after = torch.cuda.current_stream(self.device).record_event()
        started = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(after)
            started.record(self._stream)
            self._store(stores)
            self._load(loads)
            done.record(self._stream)
        return KVCopies(done, started, len(loads))

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.long, pin_memory=self._stream is not None)
        return ids.to(self.device, non_blocking=True)

    def _store(self, stores: list[tuple[int, int]]) -> None:
        for start in range(0, len(stores), STAGING_BLOCKS):
            chunk = stores[start:start + STAGING_BLOCKS]
            block_ids = [block_id for block_id, _ in chunk]
            # [n, layers, 2, block_size, heads, row]: each block one contiguous run, as on the host.
            staged = self._gpu.index_select(2, self._index(block_ids)).permute(2, 0, 1, 3, 4, 5).contiguous()
            for index, slot, length in _runs([slot for _, slot in chunk]):
                self.pool[slot:slot + length].copy_(staged[index:index + length], non_blocking=True)

    def _load(self, loads: list[tuple[int, int]]) -> None:
        for start in range(0, len(loads), STAGING_BLOCKS):
            chunk = loads[start:start + STAGING_BLOCKS]
            staged = torch.empty((len(chunk), *self.pool.shape[1:]), dtype=torch.uint8, device=self.device)
            for index, slot, length in _runs([slot for slot, _ in chunk]):
                staged[index:index + length].copy_(self.pool[slot:slot + length], non_blocking=True)
            block_ids = [block_id for _, block_id in chunk]
            self._gpu.index_copy_(2, self._index(block_ids), staged.permute(1, 2, 0, 3, 4, 5))

    def close(self) -> None:
        """Give the host memory back (the runner closes)."""
        if self._stream is not None:
            with contextlib.suppress(RuntimeError):
                self._stream.synchronize()
        if self._is_registered:
            self._is_registered = False
            torch.cuda.cudart().cudaHostUnregister(self.pool.data_ptr())
        self.pool = torch.empty(0, dtype=torch.uint8)
        self._gpu = None  # a view that would keep the KV cache's storage alive
