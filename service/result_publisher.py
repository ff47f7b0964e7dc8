"""The engine's side of the result publisher: hands each step's outputs to the publisher's
process (service/publisher_process.py) and learns what was written.

Everything the engine thread does here is a pickle of plain values onto a pipe: no text is
made, no event packed, no Redis round trip waited for. Messages keep their order, and what the
publisher reports (done, ended, lost, error) is read without waiting, once per tick.

Several processes share the work, each request always in the same one (by a hash of its id),
so that each request's writes keep their order while the processes build and wait on Redis
side by side. One process was the queue path's ceiling on the H200: busy 63% of its core at
6k tok/s, most of it building a step's records and waiting for Redis to run their script, one
after the other, so a 12k tok/s burst left the engine 0.81 of its speed.
"""

from __future__ import annotations

import multiprocessing
import time
import zlib
from multiprocessing.connection import Connection, wait

import redis

from protocol.keys import Keys
from service import publisher_process
from service.delivery import Delivery, StepOutput
from service.publisher_process import START, STARTS, STEP, UNRUN, UPDATES
from service.result_store import ResultUpdate
from shared.logging import get_logger

# forkserver: a clean process (no engine threads, no CUDA, no Ray) that has imported the
# publisher once; each scheduler's publisher forks from it in a few milliseconds.
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["service.publisher_process"])


# Publisher processes of one scheduler. Two keep up with a 12k tok/s burst on the H200 with
# room to spare; each costs a process (~100 MB with its tokenizer) and a Redis connection.
DEFAULT_NUM_PROCESSES = 2


class PublisherDied(RuntimeError):
    """A publisher's process is gone: what this scheduler makes no longer all reaches Redis."""


class _Process:
    """One publisher process, its two pipes, and how many messages it was sent and has done."""

    def __init__(self, name: str, args: tuple) -> None:
        inbox_reader, self.inbox = _CONTEXT.Pipe(duplex=False)
        self.outbox, outbox_writer = _CONTEXT.Pipe(duplex=False)
        self.process = _CONTEXT.Process(target=publisher_process.serve, name=name, daemon=True,
                                        args=(inbox_reader, outbox_writer, *args))
        self.process.start()
        inbox_reader.close()  # (the child's ends: only it holds them now)
        outbox_writer.close()
        self.num_sent = 0
        self.num_done = 0


class ResultPublisher:
    def __init__(self, redis_url: str, keys: Keys, owner: str, ttl_s: int, tokenizer,
                 num_processes: int = DEFAULT_NUM_PROCESSES) -> None:
        if num_processes < 1:
            raise ValueError(f"num_processes must be at least 1, not {num_processes}")
        self.log = get_logger("tokenfleet.result_publisher", scheduler_id=owner)
        self._processes = [_Process(f"publisher-{owner}-{i}", (redis_url, keys, owner, ttl_s, tokenizer))
                           for i in range(num_processes)]
        self._by_outbox: dict[Connection, _Process] = {p.outbox: p for p in self._processes}
        self._lost: list[str] = []
        self._ended: list[str] = []
        self.error: Exception | None = None  # the last failed write, until one succeeds
        self._closed = False

    def _process_of(self, req_id: str) -> _Process:
        return self._processes[self._index_of(req_id)]

    def _index_of(self, req_id: str) -> int:
        return zlib.crc32(req_id.encode()) % len(self._processes) if len(self._processes) > 1 else 0

    # -- what the engine thread sends ----------------------------------------------------

    def start(self, delivery: Delivery, running: ResultUpdate | None) -> None:
        """A request this scheduler now owns: what its client was sent before (by an earlier
        owner, from the record), and its running fields to write."""
        self._send(self._process_of(delivery.req_id), (START, delivery, running))

    def start_many(self, starts: list[tuple[Delivery, ResultUpdate | None]]) -> None:
        """start() for each, in order: one message per process, which its pipe reader deals out
        as one START each (an admission of hundreds of requests is a few sends, not hundreds)."""
        for process, mine in self._split(starts, lambda start: start[0].req_id):
            self._send(process, (STARTS, mine), len(mine))

    def submit_step(self, outputs: list, now: float) -> None:
        """A step's RequestOutputs (of requests this scheduler owns)."""
        for process, mine in self._split(outputs, lambda out: out.req_id):
            self._send(process, (STEP, [StepOutput.of(out) for out in mine], now))

    def submit(self, updates: list[ResultUpdate]) -> None:
        for process, mine in self._split(updates, lambda update: update.req_id):
            self._send(process, (UPDATES, mine))

    def finish_unrun(self, req_id: str, state: str, code: str, message: str) -> None:
        """End a started request that made no token (expired, cancelled, refused)."""
        self._send(self._process_of(req_id), (UNRUN, req_id, state, code, message))

    def _split(self, items: list, req_id_of) -> list[tuple[_Process, list]]:
        """Items dealt to the process of each one's request, in order (none: nothing)."""
        if len(self._processes) == 1:
            return [(self._processes[0], items)] if items else []
        dealt: dict[int, list] = {}  # process index -> its items
        for item in items:
            dealt.setdefault(self._index_of(req_id_of(item)), []).append(item)
        return [(self._processes[i], mine) for i, mine in sorted(dealt.items())]

    def _send(self, process: _Process, message: tuple, num_messages: int = 1) -> None:
        """num_messages: how many the process counts it as, done (STARTS: one per request)."""
        try:
            process.inbox.send(message)
        except (BrokenPipeError, OSError) as exc:
            raise PublisherDied(f"a result publisher's process is gone ({exc})") from None
        process.num_sent += num_messages

    # -- what the publisher reports ------------------------------------------------------

    def poll(self) -> None:
        """Read every report that has come, without waiting."""
        for process in self._processes:
            try:
                while process.outbox.poll():
                    self._take(process, process.outbox.recv())
            except (EOFError, OSError):
                self._died(process)

    def _take(self, process: _Process, report: tuple) -> None:
        num_done, ended, lost, error = report
        process.num_done += num_done
        self._ended += ended
        self._lost += lost
        self.error = None if error is None else redis.ConnectionError(error)

    def _died(self, process: _Process) -> None:
        if not self._closed:
            raise PublisherDied(f"a result publisher's process exited (code {process.process.exitcode})")

    def take_lost(self) -> list[str]:
        """Requests whose writes were refused since the last call: a successor owns them."""
        self.poll()
        lost, self._lost = self._lost, []
        return lost

    def take_ended(self) -> list[str]:
        """Requests whose terminal write (with its acknowledgement) landed since the last call."""
        self.poll()
        ended, self._ended = self._ended, []
        return ended

    @property
    def num_pending(self) -> int:
        """Messages sent and not yet written."""
        return sum(p.num_sent - p.num_done for p in self._processes)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until everything sent so far is written; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while busy := [p.outbox for p in self._processes if p.num_done < p.num_sent]:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            for outbox in wait(busy, remaining):
                process = self._by_outbox[outbox]
                try:
                    self._take(process, outbox.recv())
                except (EOFError, OSError):
                    self._died(process)
                    return False
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what was sent (for at most timeout_s), then stop the processes. Idempotent."""
        if self._closed:
            return
        try:
            if not self.drain(timeout_s):
                self.log.warning("results_left_unwritten", num_messages=self.num_pending)
        except PublisherDied as exc:
            self.log.warning("publisher_died", error=str(exc))
        self._closed = True
        for p in self._processes:
            p.inbox.close()  # its reader sees EOF, writes what it has, and exits
        for p in self._processes:
            p.process.join(timeout=timeout_s)
            if p.process.is_alive():
                p.process.kill()
                p.process.join(timeout=5)
            p.outbox.close()
