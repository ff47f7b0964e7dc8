"""RequestStore on a real Redis: the queue depth that admission reads, and queueing under an
Idempotency-Key."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from gateway.serving.store import GatewayKeys, RequestStore, Submission
from protocol.keys import CONSUMER_GROUP, Keys
from protocol.messages import RequestMessage
from shared.sampling import SamplingParams

pytestmark = pytest.mark.asyncio


async def test_concurrent_queue_depth_reads_share_one_and_see_the_queue(redis_server) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    store = RequestStore(client, GatewayKeys(), result_ttl_s=60, cancel_ttl_s=60, idempotency_ttl_s=60)
    try:
        stream = Keys().request_stream("m", "interactive")
        await client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
        for i in range(5):
            await client.xadd(stream, {"m": str(i)})
        await client.xreadgroup(CONSUMER_GROUP, "s1", {stream: ">"}, count=2)  # a scheduler took two
        await client.config_resetstat()
        depths = await asyncio.gather(*(store.queue_depth("m") for _ in range(50)))
        assert depths == [3] * 50
        stats = await client.info("commandstats")
        assert stats["cmdstat_xlen"]["calls"] == 1  # one read for the whole burst
        await client.xadd(stream, {"m": "5"})
        assert await store.queue_depth("m") == 4  # a later caller reads anew
    finally:
        await client.aclose()


async def test_an_idempotency_key_taken_by_another_request_queues_nothing(redis_server) -> None:
    """Two submits racing with one key: the one that takes it is queued, the other writes
    nothing and learns whom the key names."""
    client = aioredis.Redis.from_url(redis_server.url)
    keys = GatewayKeys()
    store = RequestStore(client, keys, result_ttl_s=60, cancel_ttl_s=60, idempotency_ttl_s=60)
    idem = store.idempotency_key(None, "order-7")

    def submission(req_id: str) -> Submission:
        message = RequestMessage.make(req_id, "m", [1, 2, 3], SamplingParams(max_tokens=2))
        return Submission(req_id, message, "completion", idempotency_key=idem, fingerprint="f")

    try:
        answers = await store.submit([submission("a" * 32), submission("b" * 32)])
        assert answers == [None, {"id": "a" * 32, "fingerprint": "f"}]
        assert await client.exists(keys.result("a" * 32)) and not await client.exists(keys.result("b" * 32))
        assert await client.xlen(keys.request_stream("m", "interactive")) == 1
        assert 0 < await client.ttl(idem) <= 60
    finally:
        await client.aclose()


async def test_a_submit_sent_twice_queues_its_request_once(redis_server) -> None:
    """The same submit call sent again (its reply was lost; a cluster client retries through a
    failover by itself) must not queue a second entry of the request, nor set its record back to
    queued once a scheduler has started it."""
    client = aioredis.Redis.from_url(redis_server.url)
    keys = GatewayKeys()
    store = RequestStore(client, keys, result_ttl_s=60, cancel_ttl_s=60, idempotency_ttl_s=60)
    req_id = "c" * 32
    message = RequestMessage.make(req_id, "m", [1, 2, 3], SamplingParams(max_tokens=2))
    try:
        assert await store.submit([Submission(req_id, message, "completion")]) == [None]
        stream = keys.request_stream("m", "interactive")
        [(entry_id, _)] = await client.xrange(stream)
        await client.hset(keys.result(req_id), "state", "running")  # a scheduler started it
        assert await store.submit([Submission(req_id, message, "completion")]) == [None]
        assert await client.xlen(stream) == 1
        record = await client.hgetall(keys.result(req_id))
        assert record[b"state"] == b"running" and record[b"entry_id"] == entry_id
    finally:
        await client.aclose()
