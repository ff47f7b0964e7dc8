"""A rank's host KV pool on its own: blocks stored and loaded back byte for byte, whatever the
cache's dtype and row size (the words it copies in); several blocks and runs of adjacent slots
per copy. On CUDA: a copy stream held back on purpose shows that a fenced store is read before
the block's next owner writes it, and a fenced load written before a step reads it, with nothing
on the host waiting for either."""

from __future__ import annotations

import pytest
import torch

from workers.host_kv_pool import STORE_RUN_BLOCKS, HostKVPool, _runs

# [layers, 2, blocks, block_size, heads, head_dim]
SHAPES = [(2, 2, 10, 4, 2, 16), (3, 2, 9, 1, 1, 3)]


def random_cache(shape, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    values = torch.randn(shape, device=device)
    return values.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", SHAPES)
def test_blocks_come_back_byte_for_byte(shape, dtype):
    cache = random_cache(shape, dtype)
    original = cache.clone()
    pool = HostKVPool(cache, num_blocks=6)
    # Slots 1, 2 adjacent (one copy), 5 apart; GPU blocks out of order.
    pool.copy([(7, 1), (2, 2), (4, 5)], []).wait()
    cache.view(torch.uint8).zero_()  # their next owners wrote over every block
    copies = pool.copy([], [(2, 0), (5, 3), (1, 8)])
    copies.wait()
    assert copies.num_loads == 3 and copies.is_done()
    as_bytes = lambda t: t.view(torch.uint8)  # noqa: E731 - (NaN != NaN: compare bytes)
    for stored_block, gpu_block in ((2, 0), (4, 3), (7, 8)):
        assert torch.equal(as_bytes(cache[:, :, gpu_block]), as_bytes(original[:, :, stored_block]))
    untouched = [b for b in range(shape[2]) if b not in (0, 3, 8)]
    assert not as_bytes(cache[:, :, untouched]).any()
    assert pool.block_bytes == shape[0] * 2 * shape[3] * shape[4] * shape[5] * cache.element_size()


def test_no_copies_queue_nothing():
    pool = HostKVPool(random_cache(SHAPES[0], torch.float32), num_blocks=2)
    assert pool.copy([], []) is None


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="a copy stream needs CUDA")
HOLD_CYCLES = 2_000_000_000  # about a second of the copy stream's time: the compute stream runs ahead


def held_back(pool: HostKVPool) -> None:
    """Each copy of `pool` starts only after the copy stream has spun for HOLD_CYCLES."""
    store, load = pool._store, pool._load

    def late_store(stores):
        if stores:
            torch.cuda._sleep(HOLD_CYCLES)  # (on the copy stream: copy() runs this inside its stream)
        store(stores)

    def late_load(loads):
        if loads:
            torch.cuda._sleep(HOLD_CYCLES)
        load(loads)

    pool._store, pool._load = late_store, late_load


@needs_cuda
def test_a_fenced_store_is_read_before_the_next_owner_writes_its_block():
    cache = random_cache(SHAPES[0], torch.bfloat16, "cuda")
    block = cache[:, :, 3].clone()
    pool = HostKVPool(cache, num_blocks=4)
    held_back(pool)
    copies = pool.copy([(3, 0)], [])
    copies.fence()
    assert not copies.is_done(), "the copy stream was not held back: this test shows nothing"
    cache[:, :, 3] = 0  # the block's next owner, on the compute stream
    torch.cuda.synchronize()
    pool.copy([], [(0, 5)]).wait()
    assert torch.equal(cache[:, :, 5], block)
    pool.close()


@needs_cuda
def test_a_fenced_load_is_written_before_a_step_reads_its_block():
    cache = random_cache(SHAPES[0], torch.bfloat16, "cuda")
    block = cache[:, :, 2].clone()
    pool = HostKVPool(cache, num_blocks=4)
    pool.copy([(2, 1)], []).wait()
    held_back(pool)
    copies = pool.copy([], [(1, 6)])
    copies.fence()
    assert not copies.is_done(), "the copy stream was not held back: this test shows nothing"
    read = cache[:, :, 6].clone()  # a step reading the loaded block, on the compute stream
    assert torch.equal(read, block)
    assert copies.load_seconds() > 0
    pool.close()


def test_runs_of_adjacent_slots_are_cut_at_their_longest():
    assert _runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert _runs(list(range(10)), max_length=4) == [(0, 0, 4), (4, 4, 4), (8, 8, 2)]


def test_a_store_longer_than_one_copy_comes_back_whole():
    shape = (2, 2, 30, 2, 1, 8)
    cache = random_cache(shape, torch.float32)
    original = cache.clone()
    pool = HostKVPool(cache, num_blocks=2 * STORE_RUN_BLOCKS + 3)
    n = 2 * STORE_RUN_BLOCKS + 1  # adjacent slots: three copies of a store
    pool.copy([(b, b) for b in range(n)], []).wait()
    cache.zero_()
    pool.copy([], [(slot, shape[2] - 1 - slot) for slot in range(n)]).wait()
    for block in range(n):
        assert torch.equal(cache[:, :, shape[2] - 1 - block], original[:, :, block])
