"""RequestStore on a real Redis: the queue depth that admission reads."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from gateway.requests.store import GatewayKeys, RequestStore
from shared.keys import CONSUMER_GROUP

pytestmark = pytest.mark.asyncio


async def test_concurrent_queue_depth_reads_share_one_and_see_the_queue(redis_server) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    store = RequestStore(client, GatewayKeys(), result_ttl_s=60, cancel_ttl_s=60, idempotency_ttl_s=60)
    try:
        stream = "tf:req:m:interactive"
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
