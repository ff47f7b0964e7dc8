"""Host-to-device uploads of step inputs through a ring of pinned host buffers.

A step's inputs are built with numpy and cross to the device as int64 arrays. A pageable source
makes the copy synchronous, and `pin_memory()` on a fresh tensor every step cost 9% of the
engine thread (py-spy, H200). So each runner keeps a few pinned buffers, allocated once (and
regrown when an array outgrows them): an upload copies the array into the next buffer, starts one
non-blocking copy from it and records an event behind that copy. A buffer is written again only
once its event has completed. Under async scheduling and pipeline parallelism several steps are in
flight, each with an upload or two; when the next buffer is still being read, the ring takes a new
one instead of waiting, so the host never waits on the device here: the ring settles at what is in
flight, and waits (`Event.synchronize`) only once it holds `max_buffers`.

On CPU an upload is zero-copy (`torch.from_numpy`): the "device" reads the array itself. Tests run
the ring itself on CPU (`staged=True`, with an event of their own making).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

MIN_BUFFER_ELEMENTS = 1 << 14  # 128 KiB: a decode step of 512 sequences fits without regrowing


@dataclass
class _Buffer:
    host: torch.Tensor  # [capacity] int64, pinned
    array: np.ndarray  # the same memory, for numpy's copy
    event: object | None = None  # a torch.cuda.Event recorded behind the last copy that read `host`

    def is_free(self) -> bool:
        return self.event is None or self.event.query()


class HostStaging:
    """The ring of one runner (one device, one stream: the current one)."""

    def __init__(self, device: torch.device, num_buffers: int = 4, max_buffers: int = 16, *,
                 staged: bool | None = None, new_event: Callable[[], object] | None = None) -> None:
        """staged: go through the ring (default: on CUDA only); new_event: what marks a copy's
        end (default: a torch.cuda.Event recorded on the current stream)."""
        self.device = device
        self.is_staged = device.type == "cuda" if staged is None else staged
        self._pinned = device.type == "cuda"
        self._new_event = new_event or _recorded_cuda_event
        self.max_buffers = max(max_buffers, num_buffers)
        self._buffers: list[_Buffer] = []
        self._next = 0  # the buffer the next upload tries first
        self.num_waits = 0  # uploads that had to wait for a copy in flight (0 in steady state)
        if self.is_staged:
            self._buffers = [self._new_buffer(MIN_BUFFER_ELEMENTS) for _ in range(num_buffers)]

    @property
    def num_buffers(self) -> int:
        return len(self._buffers)

    def upload(self, array: np.ndarray) -> torch.Tensor:
        """`array` (1-D int64) on the device, as a new device tensor; nothing waits on CUDA."""
        if not self.is_staged:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
        n = len(array)
        buffer = self._take(n)
        buffer.array[:n] = array
        out = torch.empty(n, dtype=torch.long, device=self.device)
        out.copy_(buffer.host[:n], non_blocking=True)  # from pinned memory: no host wait
        buffer.event = self._new_event()
        return out

    def _take(self, n: int) -> _Buffer:
        """A buffer no copy reads any more, holding at least n elements."""
        for offset in range(len(self._buffers)):
            i = (self._next + offset) % len(self._buffers)
            if self._buffers[i].is_free():
                return self._ready(i, n)
        if len(self._buffers) < self.max_buffers:  # every buffer is in flight: one more
            self._buffers.insert(self._next, self._new_buffer(max(n, MIN_BUFFER_ELEMENTS)))
            return self._ready(self._next, n)
        self.num_waits += 1  # more uploads in flight than max_buffers: wait for the oldest
        self._buffers[self._next].event.synchronize()
        return self._ready(self._next, n)

    def _ready(self, i: int, n: int) -> _Buffer:
        if len(self._buffers[i].array) < n:  # outgrown (no copy reads it): regrow, doubling
            self._buffers[i] = self._new_buffer(max(n, 2 * len(self._buffers[i].array)))
        self._next = (i + 1) % len(self._buffers)
        return self._buffers[i]

    def _new_buffer(self, num_elements: int) -> _Buffer:
        host = torch.empty(num_elements, dtype=torch.long, pin_memory=self._pinned)
        return _Buffer(host, host.numpy())


def _recorded_cuda_event() -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record()  # on the current stream, behind the copy just queued there
    return event
