"""ReplicaStreams against a real Redis: what a scheduler takes from its peers' own streams."""

from __future__ import annotations

import time

import pytest

from protocol.keys import CONSUMER_GROUP, Keys
from service.replica_streams import ReplicaStreams

KEYS = Keys()
MODEL = "m"


def _peer(client, peer: str, *, heartbeat: dict | None, entries: int) -> str:
    stream = KEYS.replica_stream(MODEL, peer)
    client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    client.sadd(KEYS.replica_streams(MODEL), peer)
    if heartbeat is not None:
        client.hset(KEYS.scheduler(peer), mapping=heartbeat)
    for i in range(entries):
        client.xadd(stream, {"m": f"entry-{i}"})
    return stream


@pytest.fixture
def client(redis_server):
    return redis_server.client()


def _me(client, steal_after_s: float = 60.0, forget_after_s: float = 0.0) -> ReplicaStreams:
    me = ReplicaStreams(client, KEYS, MODEL, "me", steal_after_s=steal_after_s, forget_after_s=forget_after_s)
    client.xgroup_create(me.own, CONSUMER_GROUP, id="0", mkstream=True)
    me.register()
    return me


def test_a_draining_or_drain_asked_peers_unread_entries_are_taken_at_once_up_to_the_room(client) -> None:
    draining = _peer(client, "draining", heartbeat={"model": MODEL, "draining": 1}, entries=3)
    asked = _peer(client, "asked", heartbeat={"model": MODEL, "draining": 0}, entries=2)
    client.set(KEYS.drain("asked"), time.time() + 60)
    me = _me(client)
    got = me.find_work(4, idle=False)
    assert [s for s, _, _ in got] == [asked, asked, draining, draining]
    assert len(me.find_work(10, idle=False)) == 1  # the one left
    for stream, _, _ in got:
        me.count(stream)
    me.count(me.own)
    me.count(KEYS.request_stream(MODEL, "interactive"))
    assert me.heartbeat_fields() == {"entries_routed": 1, "entries_stolen": 4, "entries_fallback": 1}


def test_a_live_peers_entries_are_stolen_only_when_idle_and_once_they_waited_the_bound(client) -> None:
    stream = _peer(client, "busy", heartbeat={"model": MODEL, "draining": 0}, entries=2)
    # (a bound wide enough that a loaded machine's pauses between these lines stay well under it)
    me = _me(client, steal_after_s=2.0)
    assert me.find_work(10, idle=True) == []  # too young
    time.sleep(2.1)
    client.xadd(stream, {"m": "young"})
    assert me.find_work(10, idle=False) == []  # not idle
    got = me.find_work(10, idle=True)
    assert [f[b"m"] for _, _, f in got] == [b"entry-0", b"entry-1"]  # the young one stays
    assert me.find_work(0, idle=True) == []  # no room


def test_a_dead_peers_stream_is_read_then_forgotten_once_empty_unless_its_owner_is_back(client) -> None:
    stream = _peer(client, "dead", heartbeat=None, entries=2)
    me = _me(client)
    assert len(me.find_work(10, idle=False)) == 2
    assert me.find_work(10, idle=False) == []  # pending (ours now) keeps it: XLEN 2
    assert client.sismember(KEYS.replica_streams(MODEL), "dead")
    client.xack(stream, CONSUMER_GROUP, *[e for e, _ in client.xrange(stream)])
    client.xtrim(stream, maxlen=0)
    client.hset(KEYS.scheduler("dead"), mapping={"model": MODEL, "draining": 0})  # restarted
    me.find_work(10, idle=False)
    assert client.sismember(KEYS.replica_streams(MODEL), "dead")
    client.delete(KEYS.scheduler("dead"))
    me.find_work(10, idle=False)
    assert not client.sismember(KEYS.replica_streams(MODEL), "dead") and not client.exists(stream)
    assert me.find_work(10, idle=False) == [] and me.peers == {}


def test_a_peer_is_forgotten_only_after_looking_dead_for_a_while(client) -> None:
    """A heartbeat lapses during one long step, and a new scheduler lists itself just before its
    first heartbeat: neither must lose its stream."""
    stream = _peer(client, "slow", heartbeat=None, entries=0)
    me = _me(client, forget_after_s=0.3)
    me.find_work(10, idle=False)
    assert client.exists(stream)
    client.hset(KEYS.scheduler("slow"), mapping={"model": MODEL, "draining": 0})  # it beats again
    me.find_work(10, idle=False)
    client.delete(KEYS.scheduler("slow"))
    time.sleep(0.35)
    me.find_work(10, idle=False)  # dead again: the clock starts over
    assert client.exists(stream)
    time.sleep(0.35)
    me.find_work(10, idle=False)
    assert not client.exists(stream)
