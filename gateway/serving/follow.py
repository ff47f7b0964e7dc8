"""Follow requests to their end: each sequence number exactly once, in order.

    subscribe (confirmed)  ->  [queue the request | read tf:res and catch up]  ->  events
Live events come through the process's one pub/sub connection. The record fills every
hole: a gap in the sequence numbers, a reconnect (RESYNC), or a quiet spell of poll_s
(a missed final event, a scheduler that died) all lead to a re-read of `tf:res:{id}`, and
what the record holds beyond the last delivered seq becomes one catch-up delta.

The follow path runs once per token per stream, so it allocates little: the router appends
events to a deque and wakes the follower with one future; the quiet-spell timer is one
timer per Watch, re-armed lazily, not one per wait; and everything that arrived together is
handed over as one batch, which the caller writes to its client with one write.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgpack

from gateway.serving.pubsub import RESYNC, EventRouter, Listener
from gateway.serving.records import Delta, ResultRecord
from gateway.serving.store import RequestStore
from protocol.messages import WIRE_VERSION, MessageDecodeError, decode_event
from protocol.result_record import EXPIRED_MESSAGE
from shared.logging import get_logger

log = get_logger("tokenfleet.gateway.requests.follow")
# The map of almost every event (a token, not the last, no logprobs): decoded here without
# building a TokenEvent first. Anything else, or a wire format that has moved on, takes
# protocol.messages.decode_event, which checks it strictly.
_PLAIN_EVENT_KEYS = frozenset({"v", "req_id", "seq", "token_ids", "text", "logprobs", "finish_reason",
                               "usage", "type", "prompt_logprobs"})


def decode_delta(data: bytes) -> Delta:
    """An event's bytes -> its Delta (MessageDecodeError when they are not a valid event)."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:  # noqa: BLE001 - msgpack raises several unrelated types; decode_event names it
        raw = None
    if type(raw) is dict and raw.keys() == _PLAIN_EVENT_KEYS and raw["v"] == WIRE_VERSION \
            and raw["type"] == "token" and raw["logprobs"] is None and raw["finish_reason"] is None \
            and raw["usage"] is None and raw["prompt_logprobs"] is None and type(raw["req_id"]) is str \
            and type(raw["text"]) is str:
        seq, ids = raw["seq"], raw["token_ids"]
        if type(seq) is int and type(ids) is list and all(type(token) is int for token in ids):
            return Delta(seq, ids, raw["text"])
    return Delta.from_event(decode_event(data))


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
        self._inbox: deque[tuple[int, bytes]] = deque()  # (follower index, event bytes), as they came
        self._waiter: asyncio.Future | None = None  # set while the consumer waits for the inbox
        self._timer: asyncio.TimerHandle | None = None  # the quiet-spell timer, armed while following
        self._idle_since = 0.0  # loop time the consumer last found the inbox empty
        self._listeners: list[Listener] = []

    @property
    def unfinished(self) -> list[str]:
        return [f.req_id for f in self.followers if not f.done]

    async def open(self) -> None:
        """Subscribe to every request's events, all at once (n choices: one round trip, not n);
        returns once Redis has confirmed them all."""
        if len(self.followers) == 1:
            self._listeners.append(await self.router.subscribe(self.followers[0].req_id, self._deliver, 0))
            return
        tasks = [asyncio.ensure_future(self.router.subscribe(follower.req_id, self._deliver, index))
                 for index, follower in enumerate(self.followers)]
        try:
            self._listeners = list(await asyncio.gather(*tasks))
        except BaseException:  # one failed, or the caller left: none stays subscribed
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            self._listeners = [t.result() for t in tasks if not t.cancelled() and t.exception() is None]
            self.close()
            raise

    def close(self) -> None:
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            self.router.unsubscribe(listener)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- the inbox (called by the router, on the event loop) ------------------------------

    def _deliver(self, index: object, data: bytes) -> None:
        self._inbox.append((index, data))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    async def _wait(self) -> bool:
        """Until something arrives (True) or poll_s passes with nothing (False)."""
        loop = asyncio.get_running_loop()
        self._idle_since = loop.time()
        if self._timer is None:
            self._timer = loop.call_at(self._idle_since + self.poll_s, self._on_timer)
        self._waiter = loop.create_future()
        try:
            return await self._waiter
        finally:
            self._waiter = None

    def _on_timer(self) -> None:
        """Fires at most once per poll_s: ends a wait that has lasted poll_s, else re-arms."""
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # not waiting: the next wait arms it again
        loop = asyncio.get_running_loop()
        due = self._idle_since + self.poll_s
        if loop.time() + 0.001 >= due:
            waiter.set_result(False)
        else:
            self._timer = loop.call_at(due, self._on_timer)

    # -- deltas -----------------------------------------------------------------------------

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

    async def batches(self) -> AsyncIterator[list[tuple[int, Delta]]]:
        """Lists of (follower index, delta), each everything that was ready at once, until every
        request has ended; an empty list is a quiet tick (nothing for poll_s)."""
        inbox = self._inbox
        followers = self.followers
        while any(not f.done for f in followers):
            if not inbox and not await self._wait():
                out = await self._poll()
                if out:
                    yield out
                yield []
                continue
            out = []
            while inbox:
                index, data = inbox.popleft()
                follower = followers[index]
                if follower.done:
                    continue
                if data == RESYNC:
                    out += await self.catch_up([index])
                    continue
                try:
                    delta = decode_delta(data)
                except MessageDecodeError as exc:
                    log.warning("bad_event", req_id=follower.req_id, error=str(exc))
                    continue
                if delta.seq < follower.next_seq:
                    continue  # delivered already (by a catch-up)
                if delta.seq > follower.next_seq:  # a hole: the record has everything up to delta.seq
                    out += await self.catch_up([index])
                    continue
                follower.next_seq += 1
                follower.done = delta.is_final
                out.append((index, delta))
            if out:
                yield out
