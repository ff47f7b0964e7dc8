"""Admission reads off the engine thread: a thread that reads the request streams and decodes
their entries, for the engine thread to take at its next tick without a Redis round trip.

On the engine thread each admission was one or two round trips while the GPU could idle, and
an empty read throttled the next by 5 ms. This thread blocks in XREADGROUP instead, so an
arrival is read the moment it lands (on a Redis Cluster it polls: service/stream_reads.py).
The engine thread keeps what must stay on it: the held-checks, the claim, the start
(service/scheduler_service.py).

Room. Entries read are this scheduler's (in its pending list): it never reads more than its
engine has room for, so that an idle peer can take the rest. The engine thread says its room at
each tick (`set_room`, from `_capacity`); entries read and not yet taken count against it, as does
the COUNT of a read in flight. An interactive entry takes a slot of both kinds; a batch entry a
free slot only (an interactive request may take a batch item's slot: the engine preempts it).
Within the room the reads follow the old rules: the own stream (routed requests) first, then the
interactive streams of every tenant at once (the room shared out, so a tenant's backlog does not
hold back another tenant's next request), then batch streams for the free slots left; tenants
are learned from the model's tenant set. While no backlog is in sight, one blocking read watches
every stream.

Entries held (read, not taken) are still this scheduler's: the claim renewer renews them (the
reader tells it, service/claim_renewer.py), and a scheduler that stops or dies before taking
them leaves them pending for a successor. A drain stops the reader (`stop_reading` waits out a
read in flight, so nothing is read once the drain is announced); what it read before is started
(a read stuck past the wait leaves its entries pending, never started here: `left_unstarted`).

Errors (Redis away, a lost consumer group, a cluster failing over): the reader backs off and
reads again; each error is also handed to the engine thread (`take_error`), whose loop handles
it as its own. Any other error ends the reader, and the engine thread raises it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import redis

from protocol.keys import Keys
from protocol.messages import MessageDecodeError, RequestMessage
from service import stream_reads
from service.tenant_streams import TenantStreams
from shared.logging import get_logger
from shared.redis_client import redis_away, refresh_cluster_view

MIN_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
# Less room than streams: no blocking read fits in the room (each stream may return one entry),
# so the streams are looked at in turns, this often, until the engine has more room.
SATURATED_POLL_S = 0.005


@dataclass
class ReadEntry:
    """A request stream entry as read: its message decoded, or why it could not be."""

    stream: str
    entry_id: str
    payload: bytes | None
    message: RequestMessage | None  # None: undecodable (`error` says why)
    error: str | None = None
    num_deliveries: int = 1
    is_batch: bool = False  # read from a batch stream: it takes a free slot only


def decode_entry(stream: str, entry_id: str, fields: dict | None, num_deliveries: int = 1,
                 is_batch: bool = False) -> ReadEntry:
    payload = (fields or {}).get(b"m")
    try:
        if payload is None:
            raise MessageDecodeError("the entry has no 'm' field")
        return ReadEntry(stream, entry_id, payload, RequestMessage.decode(payload),
                         num_deliveries=num_deliveries, is_batch=is_batch)
    except MessageDecodeError as exc:
        return ReadEntry(stream, entry_id, payload, None, str(exc), num_deliveries, is_batch)


def _usage(entries: list[ReadEntry]) -> tuple[int, int]:
    """(interactive, batch) room the entries take."""
    num_batch = sum(1 for entry in entries if entry.is_batch)
    return len(entries) - num_batch, len(entries)


class AdmissionReader:
    def __init__(self, client, keys: Keys, model: str, consumer: str, own_stream: str, *,
                 block_ms: int, on_held: Callable[[list[tuple[str, str]]], None] | None = None) -> None:
        self.client = client  # its own connection: a blocking read holds one
        self.consumer = consumer
        self.own = own_stream
        self.block_ms = block_ms
        self.tenant_streams = TenantStreams(keys, model)  # (the engine thread keeps its own)
        self._tenants_key = keys.tenants(model)
        self._on_held = on_held  # (stream, entry id) of every entry held, after each change
        self.log = get_logger("tokenfleet.admission_reader", scheduler_id=consumer)
        self._cond = threading.Condition()
        self._room = (0, 0)  # (interactive, batch) the engine has room for, held entries included
        self._reserved = (0, 0)  # the COUNT of the read in flight
        self._held: list[ReadEntry] = []  # read, not yet taken by the engine thread
        self.left_unstarted: list[ReadEntry] = []  # read after stop_reading: pending, never started here
        self._is_reading = False
        self._is_stopped = False  # draining: no more reads
        self._is_sealed = False  # stop_reading returned: a read that lands now is left unstarted
        self._error: BaseException | None = None
        self.is_running = False  # a thread reads (else the engine thread reads, at each tick)
        self._thread: threading.Thread | None = None
        self._groups_made = True  # (the engine thread makes them before the first room)
        self._had_more = True  # the last read filled a COUNT: read kind by kind, in order
        self._next_tenant_look = 0.0
        self._offsets: Counter[str] = Counter()  # kind -> the stream its next read in turns starts at

    @property
    def streams(self) -> list[str]:
        return [self.own, *self.tenant_streams.all()]

    # -- the engine thread's side ---------------------------------------------------------

    def start(self, stop: threading.Event) -> None:
        self.is_running = True
        self._thread = threading.Thread(target=self._run, args=(stop,), name="admission-reader", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            with self._cond:
                self._cond.notify_all()
            self._thread.join(timeout=timeout_s)

    def set_room(self, interactive: int, batch: int) -> None:
        """The engine's room now (its free slots, less nothing: held entries are counted here)."""
        with self._cond:
            self._room = (interactive, batch)
            self._cond.notify_all()

    def take(self, wait_s: float = 0.0) -> list[ReadEntry]:
        """What was read since the last take (waiting up to wait_s for something, on an idle
        engine); the room they take leaves the reader's with them."""
        with self._cond:
            if not self._held and wait_s > 0 and self.is_running:
                self._cond.wait_for(lambda: self._held or self._error is not None or not self.is_running,
                                    timeout=wait_s)
            taken, self._held = self._held, []
            if taken:
                used_i, used_b = _usage(taken)
                self._room = (self._room[0] - used_i, self._room[1] - used_b)
                self._tell_held()
            return taken

    def take_error(self) -> BaseException | None:
        with self._cond:
            error, self._error = self._error, None
            return error

    def stop_reading(self, timeout_s: float) -> None:
        """Read nothing more (a drain): returns once no read is in flight."""
        with self._cond:
            self._is_stopped = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._is_reading, timeout=timeout_s)
            self._is_sealed = True  # (a read stuck past the timeout: its entries are not started)

    def read_now(self, block_ms: int | None) -> int:
        """A service ticked by hand, with no reader thread: read on the calling thread (kind by
        kind, in order); returns how many entries were read."""
        assert not self.is_running, "the reader thread reads"
        room = self._free_room()
        if self._is_stopped or room[0] <= 0:
            return 0
        found = self._read(*room, block_ms=block_ms, in_order=True)
        self._held += found
        return len(found)

    # -- the thread ---------------------------------------------------------------------

    def _run(self, stop: threading.Event) -> None:
        backoff = MIN_BACKOFF_S
        try:
            while not stop.is_set():
                room = self._reserve(stop)
                if room is None:
                    continue
                found: list[ReadEntry] = []
                try:
                    found = self._read(*room, block_ms=self.block_ms, in_order=self._is_in_order())
                    backoff = MIN_BACKOFF_S
                except Exception as exc:
                    self._report(exc)
                    if not self._is_passing(exc):
                        return
                    stop.wait(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
                finally:
                    self._settle(found)
        finally:
            with self._cond:
                self.is_running = False
                self._cond.notify_all()

    def _reserve(self, stop: threading.Event) -> tuple[int, int] | None:
        """Wait until the engine has room; the room this read may fill (None: look at stop again)."""
        with self._cond:
            room = self._free_room()
            if self._is_stopped or room[0] <= 0:
                self._cond.wait(timeout=0.1)
                return None
            self._reserved = room
            self._is_reading = True
            return room

    def _settle(self, found: list[ReadEntry]) -> None:
        with self._cond:
            self._reserved = (0, 0)
            self._is_reading = False
            if self._is_sealed:
                self.left_unstarted += found  # (landed after the drain was announced: a successor's)
            elif found:
                self._held += found
                self._tell_held()
            self._cond.notify_all()

    def _free_room(self) -> tuple[int, int]:
        used_i, used_b = _usage(self._held)
        return (self._room[0] - used_i - self._reserved[0], self._room[1] - used_b - self._reserved[1])

    def _tell_held(self) -> None:
        if self._on_held is not None:  # (under the lock: the renewer's view changes in order)
            self._on_held([(entry.stream, entry.entry_id) for entry in self._held])

    def _is_in_order(self) -> bool:
        """Read kind by kind (own stream, interactive, batch) rather than all at once: while a
        backlog is in sight, and every block time (to learn new tenants)."""
        return self._had_more or time.monotonic() >= self._next_tenant_look

    def _report(self, exc: BaseException) -> None:
        with self._cond:
            self._error = exc
            self._cond.notify_all()

    def _is_passing(self, exc: BaseException) -> bool:
        """Whether the error is one to wait out (and what to do meanwhile); else a bug."""
        if redis_away(exc):
            refresh_cluster_view(self.client)
            self.log.warning("admission_read_failed", error=str(exc))
            return True
        if isinstance(exc, redis.ResponseError) and "NOGROUP" in str(exc):
            self._groups_made = False  # (FLUSHALL, a Redis restarted without its data)
            return True
        return False

    # -- the reads ----------------------------------------------------------------------

    def _read(self, interactive_room: int, batch_room: int, *, block_ms: int | None,
              in_order: bool) -> list[ReadEntry]:
        if not self._groups_made:
            stream_reads.create_groups(self.client, self.streams)
            self._groups_made = True
        if in_order:
            found = self._read_in_order(interactive_room, batch_room)
            if found or not block_ms:
                return found
        return self._read_all_at_once(interactive_room, batch_room, block_ms)

    def _read_in_order(self, interactive_room: int, batch_room: int) -> list[ReadEntry]:
        """The own stream first (with the tenant set, in one round trip), then the interactive
        streams, then batch streams for the free slots left; none blocks."""
        pipe = self.client.pipeline(transaction=False)
        pipe.smembers(self._tenants_key)
        stream_reads.queue_reads(self.client, pipe, self.consumer, [self.own], interactive_room, None)
        tenants, *replies = pipe.execute()
        self._next_tenant_look = time.monotonic() + self.block_ms / 1000
        new_streams = self.tenant_streams.learn(tenants)
        if new_streams:
            stream_reads.create_groups(self.client, new_streams)
        found = [decode_entry(*entry) for entry in stream_reads.entries(replies)]
        had_more = len(found) >= interactive_room
        if interactive_room > len(found):
            got, had_more = self._read_in_turns("interactive", interactive_room - len(found))
            found += got
        batch_room -= len(found)
        if batch_room > 0:
            got, batch_had_more = self._read_in_turns("batch", batch_room)
            found += got
            had_more = had_more or batch_had_more
        self._had_more = had_more
        return found

    def _read_in_turns(self, kind: str, room: int) -> tuple[list[ReadEntry], bool]:
        """Entries of the kind's streams, at most `room`, and whether a stream may hold more. With
        room for one each, the room is shared out in one read; else the streams take turns, the
        next read starting where this one stopped."""
        streams = self.tenant_streams.of(kind)
        is_batch = kind == "batch"
        if room >= len(streams):
            count = room // len(streams)
            found = self._read_streams(streams, count, None, is_batch)
            return found, _fills(found, count)
        start = self._offsets[kind] % len(streams)
        order = streams[start:] + streams[:start]
        found: list[ReadEntry] = []
        tried = 0
        while tried < len(order) and len(found) < room:
            window = order[tried:tried + room - len(found)]
            found += self._read_streams(window, 1, None, is_batch)
            tried += len(window)
        self._offsets[kind] = start + tried
        return found, len(found) >= room

    def _read_all_at_once(self, interactive_room: int, batch_room: int,
                          block_ms: int | None) -> list[ReadEntry]:
        """One read of every stream, blocking until something lands (what a backlog-free engine
        waits in). Batch streams take part only where the free slots give each one its COUNT."""
        streams = [self.own, *self.tenant_streams.of("interactive")]
        batch = self.tenant_streams.of("batch")
        room = interactive_room
        if batch_room >= len(streams) + len(batch):
            streams, room = streams + batch, batch_room
        if room < len(streams):
            time.sleep(SATURATED_POLL_S)  # (no read fits: the next round reads in turns)
            self._had_more = True
            return []
        count = room // len(streams)
        found = self._read_streams(streams, count, block_ms, None)
        self._had_more = _fills(found, count)
        return found

    def _read_streams(self, streams: list[str], count: int, block_ms: int | None,
                      is_batch: bool | None) -> list[ReadEntry]:
        """XREADGROUP of the streams, COUNT each (is_batch None: judged by each entry's stream)."""
        batch = set(self.tenant_streams.of("batch")) if is_batch is None else set()
        got = stream_reads.read(self.client, self.consumer, streams, count * len(streams), block_ms)
        return [decode_entry(stream, entry_id, fields,
                             is_batch=is_batch if is_batch is not None else stream in batch)
                for stream, entry_id, fields in got]


def _fills(found: list[ReadEntry], count: int) -> bool:
    """Whether some stream gave its whole COUNT (it may hold more)."""
    return any(n >= count for n in Counter(entry.stream for entry in found).values())
