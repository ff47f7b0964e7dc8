"""Follow requests to their end: each sequence number exactly once, in order.

    subscribe (confirmed)  ->  [queue the request | read tf:res and catch up]  ->  events
Live events come through the process's one pub/sub connection. The record fills every
hole: a gap in the sequence numbers, a reconnect (RESYNC), or a quiet spell of poll_s
(a missed final event, a scheduler that died) all lead to a re-read of `tf:res:{id}`, and
what the record holds beyond the last delivered seq becomes one catch-up delta.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gateway.requests.pubsub import RESYNC, EventRouter, Listener
from gateway.requests.records import Delta, ResultRecord
from gateway.requests.store import RequestStore
from shared.logging import get_logger
from shared.messages import MessageDecodeError, decode_event

log = get_logger("tokenfleet.gateway.requests.follow")
EXPIRED_MESSAGE = "the deadline passed while it was queued"


@dataclass
class Follower:
    req_id: str
    next_seq: int = 1  # the next event the client has not seen
    done: bool = False

    def from_record(self, record: ResultRecord | None, decode: Callable[[list[int]], str]) -> Delta | None:
        if record is None:  # expired from Redis (or never existed)
            self.done = True
            return Delta(self.next_seq, [], "", error={"code": "not_found", "message": "the request is gone"},
                         state="failed")
        if record.seq < self.next_seq and not (record.is_terminal and record.seq == 0):
            if record.is_terminal:
                self.done = True  # the client has seen the last event already
            return None
        delta = record.delta_after(self.next_seq - 1, decode)
        self.next_seq = record.seq + 1
        self.done = delta.is_final
        return delta


class Watch:
    """Deltas of several requests (the choices of one call), merged in arrival order."""

    def __init__(self, store: RequestStore, router: EventRouter, req_ids: list[str], *,
                 decode: Callable[[list[int]], str], poll_s: float, after_seq: int = 0) -> None:
        self.store = store
        self.router = router
        self.decode = decode
        self.poll_s = poll_s
        self.followers = [Follower(req_id, after_seq + 1) for req_id in req_ids]
        self.queue: asyncio.Queue = asyncio.Queue()  # (follower index, event bytes)
        self._listeners: list[Listener] = []

    @property
    def unfinished(self) -> list[str]:
        return [f.req_id for f in self.followers if not f.done]

    async def open(self) -> None:
        """Subscribe to every request's events; returns once Redis has confirmed them all."""
        try:
            for index, follower in enumerate(self.followers):
                self._listeners.append(await self.router.subscribe(follower.req_id, self.queue, index))
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            await self.router.unsubscribe(listener)

    async def catch_up(self, indices: list[int] | None = None) -> list[tuple[int, Delta]]:
        """Read the records and return what they hold beyond what was delivered."""
        indices = [i for i in (range(len(self.followers)) if indices is None else indices)
                   if not self.followers[i].done]
        if not indices:
            return []
        records = await self.store.read_many([self.followers[i].req_id for i in indices])
        out = []
        for i, record in zip(indices, records, strict=True):
            if record is not None and await self._expire_if_due(record):
                record = await self.store.read(record.req_id)
            delta = self.followers[i].from_record(record, self.decode)
            if delta is not None:
                out.append((i, delta))
        return out

    async def _expire_if_due(self, record: ResultRecord) -> bool:
        if record.state == "queued" and record.owner is None and record.deadline is not None \
                and time.time() > record.deadline:
            return await self.store.finish_unclaimed(record, "expired", EXPIRED_MESSAGE)
        return False

    async def _poll(self) -> list[tuple[int, Delta]]:
        """A quiet spell: look (cheaply) whether any record moved, and catch those up."""
        indices = [i for i, f in enumerate(self.followers) if not f.done]
        progress = await self.store.progress([self.followers[i].req_id for i in indices])
        moved = [i for i, (state, seq, is_due) in zip(indices, progress, strict=True)
                 if state is None or is_due or state not in ("queued", "running")
                 or seq >= self.followers[i].next_seq]
        return await self.catch_up(moved) if moved else []

    async def deltas(self) -> AsyncIterator[tuple[int | None, Delta | None]]:
        """(follower index, delta) until every request has ended; (None, None) on a quiet tick."""
        while any(not f.done for f in self.followers):
            try:
                if self.queue.empty():
                    # asyncio.timeout, not wait_for: no task per token (3.11's wait_for makes one)
                    async with asyncio.timeout(self.poll_s):
                        index, data = await self.queue.get()
                else:  # the common case under load: no timer at all
                    index, data = self.queue.get_nowait()
            except asyncio.TimeoutError:
                for item in await self._poll():
                    yield item
                yield None, None
                continue
            follower = self.followers[index]
            if follower.done:
                continue
            if data == RESYNC:
                for item in await self.catch_up([index]):
                    yield item
                continue
            try:
                event = decode_event(data)
            except MessageDecodeError as exc:
                log.warning("bad_event", req_id=follower.req_id, error=str(exc))
                continue
            if event.seq < follower.next_seq:
                continue  # delivered already (by a catch-up)
            if event.seq > follower.next_seq:  # a hole: the record has everything up to event.seq
                for item in await self.catch_up([index]):
                    yield item
                continue
            follower.next_seq += 1
            delta = Delta.from_event(event)
            follower.done = delta.is_final
            yield index, delta
