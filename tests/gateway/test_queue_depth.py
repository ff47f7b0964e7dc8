"""Admission against max_queue (gateway/fleet/queue_depth.py) on a real Redis: an estimate between
reads (no round trip per request), read anew before any refusal."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from gateway.fleet.queue_depth import QUEUE_DEPTHS, QueueDepths
from gateway.serving.store import GatewayKeys, RequestStore
from protocol.keys import CONSUMER_GROUP, Keys
from tests.gateway.conftest import MODEL

pytestmark = pytest.mark.asyncio

STREAM = Keys().request_stream("m", "interactive")
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest_asyncio.fixture
async def redis_client(redis_server):
    client = aioredis.Redis.from_url(redis_server.url)
    await client.xgroup_create(STREAM, CONSUMER_GROUP, id="0", mkstream=True)
    yield client
    await client.aclose()


def depths(client, **kwargs) -> QueueDepths:
    store = RequestStore(client, GatewayKeys(), result_ttl_s=60, cancel_ttl_s=60, idempotency_ttl_s=60)
    return QueueDepths(store, **kwargs)


async def xlen_calls(client) -> int:
    return (await client.info("commandstats")).get("cmdstat_xlen", {}).get("calls", 0)


async def test_admissions_between_reads_cost_no_round_trip_and_count_against_the_limit(redis_client):
    queue = depths(redis_client, refresh_s=60)
    await redis_client.xadd(STREAM, {"m": "0"})
    assert await queue.refusing_depth("m", 1, 4) is None  # the first reads
    await redis_client.xadd(STREAM, {"m": "1"})  # (what the submit of the admitted request writes)
    await redis_client.config_resetstat()
    for i in range(2):
        assert await queue.refusing_depth("m", 1, 4) is None
        await redis_client.xadd(STREAM, {"m": f"{2 + i}"})
    assert await xlen_calls(redis_client) == 0
    assert queue.estimate("m") == 4  # the read's 1 and the 3 admitted since
    assert await queue.refusing_depth("m", 1, 4) == 4  # refused on a read of its own
    assert await xlen_calls(redis_client) == 1


async def test_a_full_estimate_is_read_again_before_refusing(redis_client):
    queue = depths(redis_client, refresh_s=60)
    await redis_client.xadd(STREAM, {"m": "0"})
    assert await queue.refusing_depth("m", 1, 1) == 1
    await redis_client.xreadgroup(CONSUMER_GROUP, "s1", {STREAM: ">"})  # a scheduler took it
    assert queue.estimate("m") == 1  # (stale)
    assert await queue.refusing_depth("m", 1, 1) is None


async def test_an_old_estimate_is_renewed_in_the_background(redis_client):
    queue = depths(redis_client, refresh_s=0.0)
    assert await queue.refusing_depth("m", 1, 10) is None
    for i in range(3):  # another gateway's requests
        await redis_client.xadd(STREAM, {"m": str(i)})
    assert await queue.refusing_depth("m", 1, 10) is None  # on the estimate; a read starts
    deadline = time.monotonic() + 30  # (the read runs when the loaded machine gets to it)
    while queue.estimate("m") != 3:
        assert time.monotonic() < deadline, queue.estimate("m")
        await asyncio.sleep(0.02)
    await queue.close()


async def test_an_idle_process_reads_before_it_admits(redis_client):
    queue = depths(redis_client, max_age_s=0.0)
    for _ in range(3):
        assert await queue.refusing_depth("m", 1, 10) is None
    assert await xlen_calls(redis_client) >= 3


async def test_chats_are_admitted_without_reading_the_queue_each(make_client, redis_server, fake_scheduler):
    client = await make_client(max_queue=100, fleet_refresh_s=60)
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200  # reads the depth
    client.gateway_app[QUEUE_DEPTHS].refresh_s = 60
    admin = redis_server.client()
    admin.config_resetstat()
    for _ in range(5):
        assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    assert admin.info("commandstats").get("cmdstat_xlen", {}).get("calls", 0) == 0
