"""Renewing this scheduler's claim on its stream entries, from a thread of its own.

An entry nobody renewed for the lease is taken over by another scheduler (XAUTOCLAIM). Renewed
only between steps, a scheduler whose step outlasts the lease (a long prefill on a loaded CPU)
looked dead while it worked: its entries went to another replica, came back, and soon counted
as poison (`--max-deliveries`), or were admitted again into an engine that still held them.
So the claims are renewed every heartbeat on this thread, whatever the engine thread is doing,
as long as it is alive: a tick older than `max_tick_s` means a hung scheduler, whose entries
are then left to expire and be taken over. The entries come from two sources: the engine
thread's (what it runs, or finished and has not yet written), told when they change, and the
admission reader's (read, not yet started: service/admission_reader.py).
"""

from __future__ import annotations

import threading
import time

import redis

from protocol.keys import CONSUMER_GROUP
from shared.logging import get_logger
from shared.redis_client import redis_away


class ClaimRenewer:
    def __init__(self, client: redis.Redis, consumer: str, interval_s: float, max_tick_s: float) -> None:
        self.client = client
        self.consumer = consumer
        self.interval_s = interval_s
        self.max_tick_s = max_tick_s
        self._lock = threading.Lock()
        # source ("engine": what it runs or finishes; "reader": what the admission reader holds)
        # -> stream -> ids of the entries we own there
        self._entry_ids: dict[str, dict[str, list[str]]] = {}
        self._updated_at = time.monotonic()  # when the engine thread last said it is alive
        self.log = get_logger("tokenfleet.claim_renewer", scheduler_id=consumer)

    def update(self, entries: list[tuple[str, str]], *, source: str = "engine") -> None:
        """(stream, entry id) of every entry of `source` the service owns now: the engine thread's
        when they changed (it is alive too), the admission reader's held ones."""
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id in entries:
            by_stream.setdefault(stream, []).append(entry_id)
        with self._lock:
            self._entry_ids[source] = by_stream
            if source == "engine":
                self._updated_at = time.monotonic()

    def touch(self) -> None:
        """The engine thread is alive, owning what it said last (each tick: cheaper than update)."""
        self._updated_at = time.monotonic()  # (one float store: no lock needed)

    def renew(self) -> None:
        """Reset the idle time of every entry we own, so nobody takes it over."""
        with self._lock:
            entry_ids: dict[str, list[str]] = {}
            for by_stream in self._entry_ids.values():
                for stream, ids in by_stream.items():
                    entry_ids[stream] = entry_ids.get(stream, []) + ids
        for stream, ids in entry_ids.items():
            self.client.xclaim(stream, CONSUMER_GROUP, self.consumer, 0, ids, justid=True)

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval_s):
            with self._lock:
                is_alive = time.monotonic() - self._updated_at < self.max_tick_s
            if not is_alive:
                continue  # hung: let the lease run out
            try:
                self.renew()
            except Exception as exc:
                if not redis_away(exc):
                    raise
                self.log.warning("claim_renewal_failed", error=str(exc))
