"""The pinned staging ring of step uploads: a buffer is written again only once the copy that read
it has completed, the ring grows instead of waiting, and a buffer regrows for a larger array. Run
on CPU with the ring forced on (`staged=True`) and events whose completion the test decides."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.host_staging import MIN_BUFFER_ELEMENTS, HostStaging

CPU = torch.device("cpu")


class FakeEvent:
    """Stands for the CUDA event recorded behind an upload's copy."""

    def __init__(self) -> None:
        self.is_done = False
        self.num_waits = 0

    def query(self) -> bool:
        return self.is_done

    def synchronize(self) -> None:
        self.num_waits += 1
        self.is_done = True


@pytest.fixture
def events() -> list[FakeEvent]:
    return []


def _ring(events: list[FakeEvent], **kwargs) -> HostStaging:
    def new_event() -> FakeEvent:
        events.append(FakeEvent())
        return events[-1]

    return HostStaging(CPU, staged=True, new_event=new_event, **kwargs)


def _buffer_of(ring: HostStaging, event: FakeEvent) -> torch.Tensor:
    return next(b.host for b in ring._buffers if b.event is event)


def test_an_upload_copies_the_array_and_leaves_the_caller_free_to_reuse_it(events) -> None:
    ring = _ring(events)
    array = np.arange(10, dtype=np.int64)
    out = ring.upload(array)
    array[:] = -1  # the caller's next step rebuilds its arrays in place
    assert out.tolist() == list(range(10))
    assert not np.shares_memory(out.numpy(), array)


def test_a_buffer_whose_copy_is_in_flight_is_never_written(events) -> None:
    ring = _ring(events, num_buffers=2)
    ring.upload(np.full(4, 1, dtype=np.int64))
    ring.upload(np.full(4, 2, dtype=np.int64))
    first, second = events
    in_flight = {id(_buffer_of(ring, first)): 1, id(_buffer_of(ring, second)): 2}
    # Both copies in flight: the third upload takes a new buffer rather than overwrite or wait.
    ring.upload(np.full(4, 3, dtype=np.int64))
    assert ring.num_buffers == 3 and ring.num_waits == 0
    for buffer in ring._buffers:
        if id(buffer.host) in in_flight:
            assert buffer.host[:4].tolist() == [in_flight[id(buffer.host)]] * 4
    # Once the oldest copy is done, its buffer is the one reused, and the ring stops growing.
    first.is_done = True
    reused = _buffer_of(ring, first)
    ring.upload(np.full(4, 4, dtype=np.int64))
    assert ring.num_buffers == 3
    assert reused[:4].tolist() == [4] * 4
    assert _buffer_of(ring, second)[:4].tolist() == [2] * 4


def test_in_steady_state_the_ring_cycles_its_buffers_without_growing_or_waiting(events) -> None:
    ring = _ring(events, num_buffers=4)
    for step in range(50):
        ring.upload(np.full(8, step, dtype=np.int64))
        if len(events) >= 3:  # two steps in flight: the step before them has completed
            events[-3].is_done = True
    assert ring.num_buffers == 4 and ring.num_waits == 0


def test_a_full_ring_waits_for_its_oldest_copy_only(events) -> None:
    ring = _ring(events, num_buffers=2, max_buffers=3)
    for value in range(3):
        ring.upload(np.full(4, value, dtype=np.int64))
    ring.upload(np.full(4, 9, dtype=np.int64))
    assert ring.num_buffers == 3 and ring.num_waits == 1
    assert [e.num_waits for e in events[:3]] == [1, 0, 0]


def test_a_buffer_regrows_for_an_array_larger_than_it(events) -> None:
    ring = _ring(events, num_buffers=1)
    big = np.arange(MIN_BUFFER_ELEMENTS * 3, dtype=np.int64)
    assert ring.upload(big).tolist() == big.tolist()
    assert len(ring._buffers[0].array) >= len(big)
    events[-1].is_done = True
    assert ring.upload(np.arange(5, dtype=np.int64)).tolist() == list(range(5))
    assert ring.num_buffers == 1


def test_on_cpu_an_upload_is_zero_copy() -> None:
    array = np.arange(6, dtype=np.int64)
    out = HostStaging(CPU).upload(array)
    assert np.shares_memory(out.numpy(), array)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_uploads_do_not_synchronise() -> None:
    ring = HostStaging(torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # fewer uploads than max_buffers: the ring may grow, it never waits
        outs = [ring.upload(np.full(1000, i, dtype=np.int64)) for i in range(ring.max_buffers)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [int(o[-1]) for o in outs] == list(range(ring.max_buffers))
    assert ring.num_waits == 0 and ring._buffers[0].host.is_pinned()
