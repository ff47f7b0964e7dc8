"""The gateway's own pub/sub client (gateway/serving/pubsub.py) on a real Redis: it
authenticates, delivers each event to every listener of its channel, and after losing its
connection it comes back, subscribes again and tells each listener to re-read the record."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.serving import pubsub
from gateway.serving.pubsub import RESYNC, EventRouter, Liveness
from protocol.keys import Keys


async def _until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise TimeoutError("condition not reached")


@pytest.mark.asyncio
async def test_events_reach_every_listener_and_a_reconnect_resyncs_them(redis_server) -> None:
    admin = aioredis.Redis.from_url(redis_server.url)
    await admin.config_set("requirepass", "s3cret")
    url = redis_server.url.replace("redis://", "redis://:s3cret@")
    admin = aioredis.Redis.from_url(url)
    router = EventRouter(url, Keys())
    await router.start()
    got: list[tuple[object, bytes]] = []
    try:
        await _until(lambda: router.is_connected)
        first = await router.subscribe("r1", lambda tag, data: got.append((tag, data)), "a")
        await router.subscribe("r1", lambda tag, data: got.append((tag, data)), "b")
        await admin.publish(Keys().events("r1"), b"one")
        await _until(lambda: len(got) == 2)
        assert sorted(got) == [("a", b"one"), ("b", b"one")]

        got.clear()
        await admin.client_kill_filter(_type="pubsub")
        await _until(lambda: len(got) == 2)  # back, subscribed again: each listener re-reads the record
        assert sorted(got) == [("a", RESYNC), ("b", RESYNC)]
        got.clear()
        await admin.publish(Keys().events("r1"), b"two")
        await _until(lambda: len(got) == 2)
        assert {data for _, data in got} == {b"two"}

        got.clear()
        router.unsubscribe(first)
        await admin.publish(Keys().events("r1"), b"three")
        await _until(lambda: got == [("b", b"three")])
        assert router.num_channels == 1
    finally:
        await router.close()
        await admin.aclose()


@pytest.mark.asyncio
async def test_subscribing_while_redis_is_down_fails_at_once(redis_server) -> None:
    router = EventRouter(redis_server.url, Keys())
    await router.start()
    try:
        await _until(lambda: router.is_connected)
        redis_server.stop()
        await _until(lambda: not router.is_connected)
        with pytest.raises(RedisConnectionError):
            await router.subscribe("r1", lambda tag, data: None)
        assert router.num_channels == 0
        redis_server.start()
        await _until(lambda: router.is_connected)
        await router.subscribe("r1", lambda tag, data: None)  # confirmed by the new connection
    finally:
        await router.close()


class _Counting:
    """The real router, counting the subscriptions on their way at once."""

    def __init__(self, router: EventRouter) -> None:
        self.router = router
        self.in_flight = self.most_in_flight = 0

    async def subscribe(self, *args):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await self.router.subscribe(*args)
        finally:
            self.in_flight -= 1

    def unsubscribe(self, listener) -> None:
        self.router.unsubscribe(listener)


@pytest.mark.asyncio
async def test_a_watch_of_several_choices_subscribes_them_all_at_once(redis_server) -> None:
    from gateway.serving.follow import Watch

    router = EventRouter(redis_server.url, Keys())
    await router.start()
    try:
        await _until(lambda: router.is_connected)
        counting = _Counting(router)
        watch = Watch(None, counting, ["c1", "c2", "c3"], decode=str, poll_s=1.0)
        await watch.open()
        assert counting.most_in_flight == 3  # one round trip for all
        assert router.num_channels == 3
        watch.close()
        await _until(lambda: router.num_channels == 0)
    finally:
        await router.close()


def test_a_quiet_healthy_connection_is_pinged_and_kept_however_the_checks_drift() -> None:
    """Checks every 15 s that each wake 1.5 ms late, PONGs back 2 ms after their PING: the old
    rule (PING after 15 s of silence, drop after 30) saw 15 s - 0.5 ms at one check (no PING)
    and 30 s + 1 ms at the next, and dropped this connection every other minute."""
    liveness, now, last_read = Liveness(), 0.0, 0.0
    for _ in range(400):
        now += pubsub.HEALTH_CHECK_S + 0.0015
        verdict = liveness.check(now, last_read)
        assert verdict != Liveness.DEAD
        if verdict == Liveness.PING:
            last_read = now + 0.002
    busy = Liveness()  # a connection that reads events between checks is never PINGed
    assert [busy.check(t, t - 1.0) for t in (15.0, 30.0, 45.0)] == [Liveness.ALIVE] * 3


def test_a_ping_unanswered_by_the_next_check_drops_the_connection() -> None:
    liveness = Liveness()
    assert liveness.check(15.0, 0.0) == Liveness.PING
    assert liveness.check(30.0, 0.0) == Liveness.DEAD
    answered = Liveness()
    assert answered.check(15.0, 0.0) == Liveness.PING
    assert answered.check(30.0, 15.001) == Liveness.PING  # answered, quiet since: PINGed again


@pytest.mark.asyncio
async def test_a_stalled_redis_is_given_up_and_a_quiet_live_one_kept(redis_server, monkeypatch) -> None:
    """SIGSTOP keeps the socket open and silent, as a hung server or a dead link does."""
    monkeypatch.setattr(pubsub, "HEALTH_CHECK_S", 0.1)
    admin = aioredis.Redis.from_url(redis_server.url)
    router = EventRouter(redis_server.url, Keys())
    await router.start()
    got: list[bytes] = []
    try:
        await _until(lambda: router.is_connected)
        await router.subscribe("r1", lambda tag, data: got.append(data))
        for _ in range(30):  # 1.5 s, 15 checks, no traffic: PINGed, never dropped
            await asyncio.sleep(0.05)
            assert router.is_connected
        os.kill(redis_server.process.pid, signal.SIGSTOP)
        try:
            await _until(lambda: not router.is_connected, timeout_s=15.0)  # (a loaded machine)
        finally:
            os.kill(redis_server.process.pid, signal.SIGCONT)
        await _until(lambda: RESYNC in got)  # back and subscribed again
        await admin.publish(Keys().events("r1"), b"after")
        await _until(lambda: b"after" in got)
    finally:
        await router.close()
        await admin.aclose()
