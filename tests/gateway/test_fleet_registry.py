"""The gateway finds the fleet through the registry (protocol/registry.py), never by scanning
the keyspace: /ready, /v1/models, /fleet.json and /metrics cost the same with 10,000 result
records stored as with none, and a corrupt registry breaks none of them."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from gateway.core.metrics import GatewayMetrics
from gateway.fleet.tracker import FleetTracker
from gateway.serving.store import RequestStore
from protocol import registry
from protocol.keys import Keys
from tests.gateway.conftest import MODEL

KEYS = Keys()
NUM_RECORDS = 10_000


def _store_records(client, start: int = 0) -> None:
    """NUM_RECORDS finished requests' records, as a day of traffic leaves them."""
    pipe = client.pipeline(transaction=False)
    for i in range(start, start + NUM_RECORDS):
        pipe.hset(KEYS.result(f"{i:032x}"), mapping={"state": "completed", "text": "x"})
    pipe.execute()


def _keyspace_calls(client) -> int:
    """SCAN and KEYS calls the server has answered so far."""
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("scan", "keys"))


def _beat(client, name: str, model: str = MODEL, ttl_s: float = 60) -> None:
    client.hset(KEYS.scheduler(name), mapping={"model": model, "num_running": 0, "num_waiting": 0,
                                               "kv_usage": 0.0, "max_num_seqs": 8, "updated_at": time.time()})
    registry.beat(client, KEYS, registry.SCHEDULERS, name, ttl_s)


@pytest.mark.asyncio
async def test_a_fleet_refresh_costs_the_same_whatever_the_keyspace_holds(redis_server):
    plain = redis_server.client()
    _beat(plain, "s0")
    client = aioredis.Redis.from_url(redis_server.url)
    store = RequestStore(client, KEYS, result_ttl_s=60, cancel_ttl_s=60, idempotency_ttl_s=60)
    tracker = FleetTracker(client, KEYS, store, GatewayMetrics(), [MODEL], grace_s=10, refresh_s=1)

    async def commands_of_one_refresh() -> int:
        before = int(plain.info("stats")["total_commands_processed"])
        await tracker.refresh()
        return int(plain.info("stats")["total_commands_processed"]) - before

    try:
        await tracker.refresh()  # (the scripts loaded once)
        empty = await commands_of_one_refresh()
        _store_records(plain)
        _store_records(plain, NUM_RECORDS)
        assert plain.dbsize() > 2 * NUM_RECORDS
        assert await commands_of_one_refresh() == empty  # (nothing else talks to this Redis)
        assert tracker.is_served(MODEL)
        assert _keyspace_calls(plain) == 0
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_refreshes_called_together_share_one_read_of_the_registry(redis_server):
    plain = redis_server.client()
    _beat(plain, "s0")
    client = aioredis.Redis.from_url(redis_server.url)
    store = RequestStore(client, KEYS, result_ttl_s=60, cancel_ttl_s=60, idempotency_ttl_s=60)
    tracker = FleetTracker(client, KEYS, store, GatewayMetrics(), [MODEL], grace_s=10, refresh_s=1)

    def script_calls() -> int:
        return plain.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)

    try:
        await tracker.refresh()  # (the scripts loaded once)
        before = script_calls()
        await asyncio.gather(*(tracker.refresh() for _ in range(50)))  # a flood of /ready
        # The first caller's read, then one more for the 49 that came while it ran.
        assert script_calls() - before == 2
        assert tracker.is_served(MODEL)
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_ready_models_metrics_and_fleet_json_never_scan_the_keyspace(make_client, redis_server,
                                                                          fake_scheduler):
    plain = redis_server.client()
    _store_records(plain)
    client = await make_client(fleet_refresh_s=0.05)
    calls = _keyspace_calls(plain)
    for _ in range(5):
        assert (await client.get("/ready")).status == 200
        assert (await client.get("/v1/models")).status == 200
        assert (await client.get(f"/v1/models/{MODEL}")).status == 200
        assert (await client.get("/metrics")).status == 200
        view = await (await client.get("/fleet.json")).json()
        assert [s["id"] for s in view["schedulers"]] == [fake_scheduler.scheduler_id]
    await asyncio.sleep(0.3)  # (the background refresh ran several times meanwhile)
    assert _keyspace_calls(plain) == calls == 0


@pytest.mark.asyncio
async def test_a_corrupt_registry_leaves_the_live_scheduler_listed(make_client, redis_server, fake_scheduler):
    plain = redis_server.client()
    far = time.time() + 600
    plain.zadd(KEYS.registry(registry.SCHEDULERS), {b"\xff\xfe": far, b"": far, "no-hash": far, "str": far,
                                                     "junk-hash": far})
    plain.set(KEYS.scheduler("str"), "not a hash")
    plain.hset(KEYS.scheduler("junk-hash"), mapping={"model": MODEL, "num_running": "many"})
    plain.zadd(KEYS.registry(registry.GATEWAYS), {"gw-junk": far})
    plain.hset(KEYS.gateway("gw-junk"), mapping={"models": "{not json", "port": "x"})
    client = await make_client()
    ready = await client.get("/ready")
    assert ready.status == 200 and (await ready.json())["models"] == [MODEL]
    view = await (await client.get("/fleet.json")).json()
    assert fake_scheduler.scheduler_id in [s["id"] for s in view["schedulers"]]
    assert "gw-junk" in [g["id"] for g in view["gateways"]]
    assert (await client.get("/metrics")).status == 200


@pytest.mark.asyncio
async def test_a_gateway_is_listed_while_it_runs_and_unlisted_when_it_stops(make_client, redis_server):
    from gateway.api.ops.presence import gateway_id

    plain = redis_server.client()
    client = await make_client()
    deadline = time.monotonic() + 30
    while gateway_id() not in registry.live_members(plain, KEYS)[registry.GATEWAYS]:  # (its first beat)
        assert time.monotonic() < deadline, "the gateway never listed itself"
        await asyncio.sleep(0.05)
    await client.close()
    assert registry.live_members(plain, KEYS)[registry.GATEWAYS] == []
    assert not plain.exists(KEYS.gateway(gateway_id()))
