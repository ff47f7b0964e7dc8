"""One pub/sub connection per gateway process, shared by every request it follows.

A reader task takes each message off the connection and puts it on the queue of every
listener of its channel (`tf:ev:{id}`). `subscribe` returns only once Redis has confirmed
the subscription, so a caller that then reads `tf:res:{id}` (or queues the request) cannot
miss an event between the two. After a reconnect, events published meanwhile are lost to
pub/sub: every listener then gets RESYNC and re-reads the record, which holds everything.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.keys import Keys
from shared.logging import get_logger

RESYNC = b""  # put on every listener's queue after a reconnect (no real event is empty)
SUBSCRIBE_TIMEOUT_S = 5.0
MAX_BACKOFF_S = 2.0


@dataclass
class Listener:
    channel: bytes
    queue: asyncio.Queue  # receives (tag, message bytes)
    tag: object
    id: int = field(default_factory=itertools.count().__next__)


class EventRouter:
    def __init__(self, redis_url: str, keys: Keys) -> None:
        self.keys = keys
        # No socket timeout: the reader waits on this connection for as long as it is quiet.
        self._client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=2, health_check_interval=15)
        self._pubsub = self._client.pubsub()
        # Keeps the connection subscribed to something, so the reader always has one.
        self._home = f"{keys.prefix}gateway:{uuid.uuid4().hex}".encode()
        self._listeners: dict[bytes, dict[int, Listener]] = {}  # channel -> listener id -> listener
        self._confirmed: dict[bytes, asyncio.Future] = {}  # channel -> set once Redis confirms
        self._lock = asyncio.Lock()  # one command at a time on the shared connection
        self._task: asyncio.Task | None = None
        self._is_connected = False
        self._has_home = False
        self._is_closing = False
        self.log = get_logger("tokenfleet.gateway.requests.pubsub")

    @property
    def num_channels(self) -> int:
        return len(self._listeners)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="event-router")

    async def close(self) -> None:
        self._is_closing = True  # redis-py may turn the cancel below into a ConnectionError
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._pubsub.aclose()
        await self._client.aclose()

    # -- listeners --------------------------------------------------------------------

    async def subscribe(self, req_id: str, queue: asyncio.Queue, tag: object = None) -> Listener:
        channel = self.keys.events(req_id).encode()
        listener = Listener(channel, queue, tag)
        listeners = self._listeners.get(channel)
        if listeners is None:
            listeners = self._listeners[channel] = {}
            self._confirmed[channel] = asyncio.get_running_loop().create_future()
            listeners[listener.id] = listener
            try:
                async with self._lock:
                    await self._pubsub.subscribe(channel)
            except BaseException:
                await self.unsubscribe(listener)
                raise
        else:
            listeners[listener.id] = listener
        confirmed = self._confirmed.get(channel)
        if confirmed is not None:
            try:
                await asyncio.wait_for(asyncio.shield(confirmed), SUBSCRIBE_TIMEOUT_S)
            except BaseException:
                await self.unsubscribe(listener)
                raise
        return listener

    async def unsubscribe(self, listener: Listener) -> None:
        listeners = self._listeners.get(listener.channel)
        if listeners is None or listeners.pop(listener.id, None) is None or listeners:
            return
        del self._listeners[listener.channel]
        confirmed = self._confirmed.pop(listener.channel, None)
        if confirmed is not None and not confirmed.done():
            confirmed.cancel()
        try:
            async with self._lock:
                await self._pubsub.unsubscribe(listener.channel)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            pass  # the connection is gone, and the subscription with it

    # -- the reader -------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.1
        while not self._is_closing:
            try:
                if not self._has_home:
                    async with self._lock:
                        await self._pubsub.subscribe(self._home)
                    self._pubsub.connection.register_connect_callback(self._on_connect)
                    self._has_home = self._is_connected = True
                message = await self._pubsub.get_message(timeout=1.0)
                backoff = 0.1
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                if self._is_closing:
                    return
                if self._is_connected:
                    self.log.warning("pubsub_disconnected", error=str(exc))
                self._is_connected = False
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            if message is not None:
                self._dispatch(message)

    def _dispatch(self, message: dict) -> None:
        kind = message["type"]
        channel = message["channel"]
        if kind == "message":
            for listener in self._listeners.get(channel, {}).values():
                listener.queue.put_nowait((listener.tag, message["data"]))
        elif kind == "subscribe":
            confirmed = self._confirmed.pop(channel, None)
            if confirmed is not None and not confirmed.done():
                confirmed.set_result(True)

    async def _on_connect(self, connection) -> None:
        """(Re)connected: whatever was published while we were away is in tf:res only."""
        if not self._is_connected:
            self.log.info("pubsub_connected", num_channels=len(self._listeners))
        self._is_connected = True
        for listeners in self._listeners.values():
            for listener in listeners.values():
                listener.queue.put_nowait((listener.tag, RESYNC))
