"""The engine's side of the result publisher: hands each step's outputs to the publisher's
process (service/publisher_process.py) and learns what was written.

Everything the engine thread does here is a pickle of plain values onto a pipe: no text is
made, no event packed, no Redis round trip waited for. Messages keep their order, and what the
publisher reports (done, ended, lost, error) is read without waiting, once per tick.
"""

from __future__ import annotations

import multiprocessing
import time

import redis

from protocol.keys import Keys
from service import publisher_process
from service.delivery import Delivery, StepOutput
from service.publisher_process import START, STEP, UNRUN, UPDATES
from service.result_store import ResultUpdate
from shared.logging import get_logger

# forkserver: a clean process (no engine threads, no CUDA, no Ray) that has imported the
# publisher once; each scheduler's publisher forks from it in a few milliseconds.
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["service.publisher_process"])


class PublisherDied(RuntimeError):
    """The publisher's process is gone: nothing this scheduler makes reaches Redis any more."""


class ResultPublisher:
    def __init__(self, redis_url: str, keys: Keys, owner: str, ttl_s: int, tokenizer) -> None:
        self.log = get_logger("tokenfleet.result_publisher", scheduler_id=owner)
        inbox_reader, self._inbox = _CONTEXT.Pipe(duplex=False)
        self._outbox, outbox_writer = _CONTEXT.Pipe(duplex=False)
        self._process = _CONTEXT.Process(
            target=publisher_process.serve, name=f"publisher-{owner}", daemon=True,
            args=(inbox_reader, outbox_writer, redis_url, keys, owner, ttl_s, tokenizer))
        self._process.start()
        inbox_reader.close()  # (the child's ends: only it holds them now)
        outbox_writer.close()
        self._num_sent = 0
        self._num_done = 0
        self._lost: list[str] = []
        self._ended: list[str] = []
        self.error: Exception | None = None  # the last failed write, until one succeeds
        self._closed = False

    # -- what the engine thread sends ----------------------------------------------------

    def start(self, delivery: Delivery, running: ResultUpdate | None) -> None:
        """A request this scheduler now owns: what its client was sent before (by an earlier
        owner, from the record), and its running fields to write."""
        self._send((START, delivery, running))

    def submit_step(self, outputs: list, now: float) -> None:
        """A step's RequestOutputs (of requests this scheduler owns)."""
        if outputs:
            self._send((STEP, [StepOutput.of(out) for out in outputs], now))

    def submit(self, updates: list[ResultUpdate]) -> None:
        if updates:
            self._send((UPDATES, updates))

    def finish_unrun(self, req_id: str, state: str, code: str, message: str) -> None:
        """End a started request that made no token (expired, cancelled, refused)."""
        self._send((UNRUN, req_id, state, code, message))

    def _send(self, message: tuple) -> None:
        try:
            self._inbox.send(message)
        except (BrokenPipeError, OSError) as exc:
            raise PublisherDied(f"the result publisher's process is gone ({exc})") from None
        self._num_sent += 1

    # -- what the publisher reports ------------------------------------------------------

    def poll(self) -> None:
        """Read every report that has come, without waiting."""
        try:
            while self._outbox.poll():
                self._take(self._outbox.recv())
        except (EOFError, OSError):
            self._died()

    def _take(self, report: tuple) -> None:
        num_done, ended, lost, error = report
        self._num_done += num_done
        self._ended += ended
        self._lost += lost
        self.error = None if error is None else redis.ConnectionError(error)

    def _died(self) -> None:
        if not self._closed:
            raise PublisherDied(f"the result publisher's process exited (code {self._process.exitcode})")

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
        return self._num_sent - self._num_done

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until everything sent so far is written; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._num_done < self._num_sent:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            try:
                if self._outbox.poll(remaining):
                    self._take(self._outbox.recv())
            except (EOFError, OSError):
                self._died()
                return False
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what was sent (for at most timeout_s), then stop the process. Idempotent."""
        if self._closed:
            return
        try:
            if not self.drain(timeout_s):
                self.log.warning("results_left_unwritten", num_messages=self.num_pending)
        except PublisherDied as exc:
            self.log.warning("publisher_died", error=str(exc))
        self._closed = True
        self._inbox.close()  # the publisher's reader sees EOF, writes what it has, and exits
        self._process.join(timeout=timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=5)
        self._outbox.close()
