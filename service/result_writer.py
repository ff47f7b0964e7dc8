"""Each step's results go to Redis from a thread of their own, so the engine loop never waits
for Redis: while the GPU runs step n+1, this thread builds, packs and writes step n.

Order is kept: batches are written in the order they were submitted, one script call per
round trip (when the writer falls behind, the batches waiting are joined into one call, still
in order). A batch that fails to reach Redis is retried, with backoff, before anything after
it; meanwhile `error` says so and the service pauses. The fencing (ownership check),
exactly-once appends and acknowledgements are the store's write script, unchanged; what the
writer adds is only where and when it runs.

When: the engine thread opens `gate` while it waits for the GPU (the sampler's copy of the
chosen ids, GIL released), and this thread works in chunks between looks at it, so that its
Python work does not hold the GIL while the engine thread launches the next step.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import redis

from service.result_store import ResultStore, ResultUpdate
from shared.logging import get_logger

MAX_BACKOFF_S = 5.0
# The longest the writer waits for its gate to open before it writes anyway (a CPU engine, or a
# long eager step, never waits on a GPU).
MAX_GATE_WAIT_S = 0.05
# Requests built and packed between two looks at the gate: small enough that the engine thread,
# back from the GPU, finds the GIL free within a few hundred microseconds.
CHUNK_SIZE = 32


# A step's outputs, and the function that turns them into updates on this thread.
StepItem = tuple[list, float]
BuildUpdates = Callable[[list, float], list[ResultUpdate]]


class ResultWriter:
    def __init__(self, results: ResultStore, scheduler_id: str, build_updates: BuildUpdates) -> None:
        self.results = results
        self.build_updates = build_updates
        self.log = get_logger("tokenfleet.result_writer", scheduler_id=scheduler_id)
        # In submission order: ready updates, or a step's outputs still to be turned into updates.
        self._queue: deque[list[ResultUpdate] | StepItem] = deque()
        self._cond = threading.Condition()
        self._num_writing = 0  # batches taken off the queue and not yet written
        self._lost_req_ids: list[str] = []  # another scheduler owns them now
        self._ended_req_ids: list[str] = []  # terminal state written and stream entry acknowledged
        self.error: Exception | None = None  # the last failed write, until one succeeds
        # Open while the engine thread waits (for the GPU, or on Redis when idle): this thread's
        # Python work then costs that thread nothing. Open unless the engine thread says otherwise.
        self.gate = threading.Event()
        self.gate.set()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="result-writer", daemon=True)
        self._thread.start()

    # -- the engine thread's side ---------------------------------------------------------

    def submit(self, updates: list[ResultUpdate]) -> None:
        if not updates:
            return
        with self._cond:
            self._queue.append(updates)
            self._cond.notify_all()

    def submit_step(self, outputs: list, now: float) -> None:
        """A step's outputs: this thread builds their events and records (packing, msgpack)
        while the engine thread runs the next step."""
        if not outputs:
            return
        with self._cond:
            self._queue.append((outputs, now))
            self._cond.notify_all()

    def take_lost(self) -> list[str]:
        """Requests whose writes were refused since the last call: a successor owns them."""
        with self._cond:
            lost, self._lost_req_ids = self._lost_req_ids, []
        return lost

    def take_ended(self) -> list[str]:
        """Requests whose terminal write (with its acknowledgement) landed since the last call."""
        with self._cond:
            ended, self._ended_req_ids = self._ended_req_ids, []
        return ended

    @property
    def num_pending(self) -> int:
        """Batches submitted and not yet written."""
        with self._cond:
            return len(self._queue) + self._num_writing

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until everything submitted so far is written; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._num_writing:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued (for at most timeout_s), then stop the thread."""
        if not self.drain(timeout_s):
            self.log.warning("results_left_unwritten", num_batches=self.num_pending)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)

    # -- the writer thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed and drained
                items = list(self._queue)
                self._num_writing = len(items)
                self._queue.clear()
            updates, packed = self._build_and_pack(items)
            self.gate.wait(MAX_GATE_WAIT_S)
            self._write_until_done(updates, packed)
            with self._cond:
                self._num_writing = 0
                self._cond.notify_all()

    def _build_and_pack(self, items: list) -> tuple[list[ResultUpdate], list[list]]:
        """Every item's updates, packed for the store, a chunk at a time between looks at the gate."""
        updates: list[ResultUpdate] = []
        packed: list[list] = []
        for item in items:
            if isinstance(item, tuple):
                outputs, now = item
                for start in range(0, len(outputs), CHUNK_SIZE):
                    self.gate.wait(MAX_GATE_WAIT_S)
                    chunk = self.build_updates(outputs[start:start + CHUNK_SIZE], now)
                    updates += chunk
                    packed += [self.results.pack(update) for update in chunk]
            else:
                self.gate.wait(MAX_GATE_WAIT_S)
                updates += item
                packed += [self.results.pack(update) for update in item]
        return updates, packed

    def _write_until_done(self, updates: list[ResultUpdate], packed: list[list]) -> None:
        backoff = 0.1
        while True:
            try:
                owned = self.results.write_packed(packed)
                break
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self.error = exc
                self.log.warning("result_write_failed", error=str(exc), retry_in_s=backoff)
                if self._closed:
                    return  # stopping: a successor resumes from what was written
                time.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
        self.error = None
        lost = [u.req_id for u, is_owner in zip(updates, owned, strict=True) if not is_owner]
        ended = [u.req_id for u in updates if u.ack_entry_id is not None]
        with self._cond:
            self._lost_req_ids += lost
            self._ended_req_ids += ended
