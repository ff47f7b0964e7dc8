"""The registry of live processes (protocol/registry.py) on a real Redis: who is listed, who
drops out, and what a corrupt registry does to a listing (nothing)."""

from __future__ import annotations

import time

from redis.crc import key_slot

from protocol import registry
from protocol.keys import Keys

KEYS = Keys()


def _scheduler(client, name: str, ttl_s: float, **fields) -> None:
    client.hset(KEYS.scheduler(name), mapping={"model": "m", **fields})
    registry.beat(client, KEYS, registry.SCHEDULERS, name, ttl_s)


def test_a_member_whose_heartbeat_lapsed_is_dropped_from_the_registry_when_read(redis_server):
    client = redis_server.client()
    _scheduler(client, "alive", 60)
    _scheduler(client, "dead", -1)  # its heartbeat lapsed a second ago (its hash not yet expired)
    assert registry.live_members(client, KEYS)[registry.SCHEDULERS] == ["alive"]
    assert client.zscore(KEYS.registry(registry.SCHEDULERS), "dead") is None  # pruned, not just hidden
    assert list(registry.read_live(client, KEYS)[registry.SCHEDULERS]) == ["alive"]


def test_a_scheduler_that_stops_beating_disappears_once_its_ttl_passes(redis_server):
    client = redis_server.client()
    _scheduler(client, "short", 0.2)
    _scheduler(client, "long", 600)
    assert sorted(registry.live_members(client, KEYS)[registry.SCHEDULERS]) == ["long", "short"]
    deadline = time.monotonic() + 30
    while "short" in registry.live_members(client, KEYS)[registry.SCHEDULERS]:
        assert time.monotonic() < deadline, "a lapsed member is still listed"
        time.sleep(0.05)
    assert registry.live_members(client, KEYS)[registry.SCHEDULERS] == ["long"]
    assert client.zcard(KEYS.registry(registry.SCHEDULERS)) == 1


def test_a_beat_renews_the_member_and_leave_removes_it(redis_server):
    client = redis_server.client()
    registry.beat(client, KEYS, registry.GATEWAYS, "gw-1", -1)
    registry.beat(client, KEYS, registry.GATEWAYS, "gw-1", 60)  # (the next beat moves its expiry on)
    assert registry.live_members(client, KEYS)[registry.GATEWAYS] == ["gw-1"]
    registry.leave(client, KEYS, registry.GATEWAYS, "gw-1")
    assert registry.live_members(client, KEYS) == {registry.SCHEDULERS: [], registry.GATEWAYS: []}


def test_corrupt_members_and_missing_hashes_never_break_a_listing(redis_server):
    client = redis_server.client()
    _scheduler(client, "good", 60, num_running=1)
    reg = KEYS.registry(registry.SCHEDULERS)
    client.zadd(reg, {b"\xff\xfe not utf-8": time.time() + 600, b"": time.time() + 600,
                      "no-hash": time.time() + 600, "a-string": time.time() + 600})
    client.set(KEYS.scheduler("a-string"), "not a hash")  # WRONGTYPE for HGETALL
    live = registry.read_live(client, KEYS, [registry.SCHEDULERS])[registry.SCHEDULERS]
    assert list(live) == ["good"] and live["good"][b"num_running"] == b"1"


def test_registries_share_one_cluster_slot_and_no_key_is_a_pattern():
    slots = {key_slot(Keys(partitions=16).registry(kind).encode()) for kind in registry.REGISTRY_KINDS}
    assert len(slots) == 1
    assert not [name for name in dir(Keys) if name.endswith("_pattern")]
