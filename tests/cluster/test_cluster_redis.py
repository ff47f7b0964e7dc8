"""The Redis layer on a real Redis Cluster: one client factory, each request's keys on one slot,
the scripts and reads split by partition, sharded pub/sub, and every shard in the status."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from redis.cluster import RedisCluster

from protocol.keys import CONSUMER_GROUP, keys_for
from protocol.messages import RequestMessage
from service import stream_reads
from service.result_store import ResultStore, ResultUpdate
from shared.redis_client import CLUSTER_PARTITIONS, connect, connect_async
from shared.sampling import SamplingParams

pytestmark = pytest.mark.cluster


def _slot(client: RedisCluster, key: str) -> int:
    return client.keyslot(key)


def _sharded_messages(pubsub, count: int, timeout_s: float = 10.0) -> list[dict]:
    """`count` messages (confirmations included) from a sharded subscriber of several nodes
    (redis-py waits its timeout on each node in turn: short waits, many times)."""
    deadline = time.monotonic() + timeout_s
    got: list[dict] = []
    while len(got) < count and time.monotonic() < deadline:
        message = pubsub.get_sharded_message(timeout=0.01)
        if message is not None:
            got.append(message)
    return got


def test_a_cluster_url_makes_a_cluster_client_and_a_request_s_keys_share_a_slot(redis_cluster) -> None:
    client = connect(redis_cluster.url)
    assert isinstance(client, RedisCluster)
    keys = keys_for(redis_cluster.url)
    assert keys.partitions == CLUSTER_PARTITIONS
    for req_id in ("a" * 32, "0123456789abcdef0123456789abcdef", "job-1.7.0"):
        same = {keys.result(req_id), keys.events(req_id), keys.cancelled(req_id),
                keys.stream_for(req_id, "m{odd}", "interactive"), keys.stream_for(req_id, "m", "batch", "t1")}
        assert len({_slot(client, key) for key in same}) == 1, same
    # The partitions land on every shard (several each), so slots can move.
    nodes = {client.get_node_from_key(f"x{keys.tag(p)}").name for p in range(keys.partitions)}
    assert len(nodes) == 3
    idem = keys.idempotency_for("api-key", "client-key")
    assert keys.partition(keys.request_id(idem)) == keys.partition_of_key(idem)


def test_one_step_s_writes_span_every_partition_and_publish_on_their_shard(redis_cluster) -> None:
    client = connect(redis_cluster.url)
    keys = keys_for(redis_cluster.url)
    store = ResultStore(client, keys, "s1", ttl_s=60)
    req_ids = [f"req{i:02d}" for i in range(40)]
    assert len({keys.partition(r) for r in req_ids}) == CLUSTER_PARTITIONS
    pubsub = client.pubsub()
    for req_id in req_ids:
        pubsub.ssubscribe(keys.events(req_id))
    assert len(_sharded_messages(pubsub, len(req_ids))) == len(req_ids)  # each confirmation
    entries = {}
    for req_id in req_ids:
        stream = keys.stream_for(req_id, "m", "interactive")
        try:
            client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError:
            pass
        entries[req_id] = (stream, client.xadd(stream, {"m": b"x"}).decode())
    # The claim reads every record and flag, atomically per partition, in one round trip.
    progress, flags = store.claim_many(req_ids, [keys.cancelled(r) for r in req_ids])
    assert len(progress) == 40 and flags == [False] * 40
    client.set(keys.cancelled(req_ids[3]), 1)
    flags = store.claim_many(req_ids[:5], [keys.cancelled(r) for r in req_ids[:5]])[1]
    assert flags == [False] * 3 + [True, False]
    updates = [ResultUpdate(r, entries[r][0], {"state": "finished", "seq": 1}, event=f"e-{r}".encode(),
                            ack_entry_id=entries[r][1]) for r in req_ids]
    assert store.write(updates) == [True] * 40
    got = [m["data"].decode().removeprefix("e-") for m in _sharded_messages(pubsub, 40)]
    assert sorted(got) == req_ids  # each event once, on its own shard
    assert all(client.hget(keys.result(r), "state") == b"finished" for r in req_ids)
    assert all(client.xlen(entries[r][0]) == 0 for r in req_ids)  # acknowledged and deleted
    # Another owner's write is refused, per request.
    other = ResultStore(client, keys, "s2", ttl_s=60)
    assert other.write(updates[:2]) == [False, False]


def test_reads_split_by_partition_and_a_blocking_read_waits_for_an_entry(redis_cluster) -> None:
    client = connect(redis_cluster.url)
    keys = keys_for(redis_cluster.url)
    streams = keys.request_streams("reads", "interactive")
    for stream in streams:
        client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    client.xadd(streams[5], {"m": b"five"})
    client.xadd(streams[11], {"m": b"eleven"})
    found = stream_reads.read(client, "c1", streams, room=8, block_ms=None)
    assert sorted(f[b"m"] for _, _, f in found) == [b"eleven", b"five"]
    assert stream_reads.read(client, "c1", streams, room=8, block_ms=50) == []

    async def later() -> None:
        await asyncio.sleep(0.2)
        await asyncio.to_thread(client.xadd, streams[2], {"m": b"two"})

    async def both():
        writer = asyncio.create_task(later())
        found = await asyncio.to_thread(stream_reads.read, client, "c1", streams, 8, 3000)
        await writer
        return found

    assert [f[b"m"] for _, _, f in asyncio.run(both())] == [b"two"]


@pytest.mark.asyncio
async def test_the_gateway_s_submit_waits_for_a_replica_and_queues_in_its_partition(redis_cluster) -> None:
    from gateway.serving.store import RequestStore, Submission

    client = connect_async(redis_cluster.url)
    keys = keys_for(redis_cluster.url)
    store = RequestStore(client, keys, result_ttl_s=60, cancel_ttl_s=60, idempotency_ttl_s=60)
    assert store.is_cluster
    subs = []
    for i in range(20):
        req_id = keys.request_id()
        message = RequestMessage.make(req_id, "sub", [1, 2, 3], SamplingParams(max_tokens=4), tenant="t1"
                                      if i % 2 else None)
        subs.append(Submission(req_id, message, "completion", lease_until=None))
    idem = keys.idempotency_for(None, "k1")
    first_id = keys.request_id(idem)  # (in the key's partition: one script writes both)
    first = Submission(first_id, RequestMessage.make(first_id, "sub", [1], SamplingParams(max_tokens=1)),
                       "completion", idempotency_key=idem, fingerprint="f")
    assert await store.submit([*subs, first]) == [None] * 21
    for sub in subs:
        stream = keys.stream_for(sub.req_id, "sub", "interactive", sub.message.tenant)
        record = await store.read(sub.req_id)
        assert record.state == "queued" and record.entry_id is not None
        assert [e[0].decode() for e in await client.xrange(stream)].count(record.entry_id) == 1
    assert await client.smembers(keys.tenants("sub")) == {b"t1"}
    again = Submission(keys.request_id(idem), first.message, "completion", idempotency_key=idem,
                       fingerprint="f")
    assert await store.submit([again]) == [{"id": first.req_id, "fingerprint": "f"}]
    assert await store.queue_depth("sub") == 21
    await client.aclose()


@pytest.mark.asyncio
async def test_status_shows_every_shard(redis_cluster) -> None:
    from gateway.api.ops.fleet_view import collect_fleet_view
    from tokenfleet.status_cli import format_view

    client = connect_async(redis_cluster.url)
    deadline = time.monotonic() + 30
    while True:  # (a replica shows as "loading" for a moment after its first sync)
        view = await collect_fleet_view(client, keys_for(redis_cluster.url))
        shards = view["redis"]
        healths = [r["health"] for s in shards for r in s["replicas"]]
        if healths == ["online"] * 3 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    await client.aclose()
    assert len(shards) == 3 and sum(s["slots"] for s in shards) == 16384
    assert healths == ["online"] * 3
    text = format_view(view, redis_cluster.url)
    for shard in shards:
        assert shard["primary"] in text

