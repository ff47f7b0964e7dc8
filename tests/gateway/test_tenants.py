"""Tenants through the gateway (fake scheduler, real Redis): keys map to tenants, limits answer
429 with Retry-After and the limit's name, leases end with their requests, queue per tenant."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from gateway.tenants.directory import TenantDirectory
from gateway.tenants.limits import OUTPUT_ESTIMATE_TOKENS
from protocol.keys import Keys
from tests.gateway.conftest import MODEL
from tests.gateway.fake_scheduler import FakeScheduler

pytestmark = pytest.mark.asyncio
KEYS = Keys()
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def tenants(**limits) -> TenantDirectory:
    return TenantDirectory.from_map({"tenants": {
        "team-a": {"keys": ["key-a"], **limits},
        "team-b": {"keys": ["key-b"]},
        "ops": {"keys": ["key-ops"], "admin": True},
    }})


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def test_a_tenant_key_is_accepted_and_its_requests_carry_the_tenant(make_client, fake_scheduler):
    client = await make_client(tenants=tenants(), api_keys=("plain",))
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=auth("key-a"))).status == 200
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=auth("plain"))).status == 200
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=auth("nope"))).status == 401
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 401
    assert [m.tenant for m in fake_scheduler.seen] == ["team-a", None]
    assert fake_scheduler.client.smembers(KEYS.tenants(MODEL)) == {b"team-a"}


async def test_requests_per_minute_is_a_429_naming_the_limit(make_client, fake_scheduler):
    client = await make_client(tenants=tenants(requests_per_minute=2))
    for _ in range(2):
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=auth("key-a"))).status == 200
    response = await client.post("/v1/chat/completions", json=CHAT, headers=auth("key-a"))
    assert response.status == 429
    assert 1 <= int(response.headers["Retry-After"]) <= 60
    error = (await response.json())["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "requests_per_minute"
    assert "requests_per_minute" in error["message"]
    metrics = await (await client.get("/metrics", headers=auth("key-ops"))).text()  # names tenants: admins
    refusals = 'tokenfleet_gateway_tenant_refusals_total{limit="requests_per_minute",tenant="team-a"} 1.0'
    assert refusals in metrics
    # Another tenant is not affected.
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=auth("key-b"))).status == 200


async def test_tokens_per_minute_counts_prompt_and_max_tokens(make_client, fake_scheduler):
    client = await make_client(tenants=tenants(tokens_per_minute=100))
    body = {**CHAT, "max_tokens": 60}
    assert (await client.post("/v1/chat/completions", json=body, headers=auth("key-a"))).status == 200
    response = await client.post("/v1/chat/completions", json=body, headers=auth("key-a"))
    assert response.status == 429 and (await response.json())["error"]["code"] == "tokens_per_minute"
    too_big = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 500},
                                headers=auth("key-a"))
    assert too_big.status == 400 and (await too_big.json())["error"]["param"] == "max_tokens"


async def test_concurrency_leases_end_with_the_request_or_its_client(make_client, redis_server, tokenizer):
    leases = KEYS.tenant_leases("team-a")
    with FakeScheduler(redis_server.url, MODEL, tokenizer, token_delay_s=0.05) as fake:
        client = await make_client(tenants=tenants(max_concurrent_requests=2))
        slow = {**CHAT, "max_tokens": 40, "stream": True}
        first = await client.post("/v1/chat/completions", json=slow, headers=auth("key-a"))
        second = await client.post("/v1/requests", json={**CHAT, "max_tokens": 40, "kind": "chat"},
                                   headers=auth("key-a"))
        assert first.status == 200 and second.status == 202
        assert fake.client.zcard(leases) == 2
        third = await client.post("/v1/chat/completions", json=CHAT, headers=auth("key-a"))
        assert third.status == 429 and third.headers["Retry-After"] == "1"
        assert (await third.json())["error"]["code"] == "max_concurrent_requests"
        # The streaming client leaves: its lease ends at once.
        first.close()
        for _ in range(100):
            if fake.client.zcard(leases) == 1:
                break
            await asyncio.sleep(0.05)
        assert fake.client.zcard(leases) == 1
        # The submitted one ends in the scheduler, which ends its lease.
        for _ in range(400):
            if fake.client.zcard(leases) == 0:
                break
            await asyncio.sleep(0.05)
        assert fake.client.zcard(leases) == 0
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=auth("key-a"))).status == 200


async def test_cancelling_a_queued_request_ends_its_lease(make_client, redis_server, tokenizer):
    with FakeScheduler(redis_server.url, MODEL, tokenizer, consume=False):  # alive, takes nothing
        client = await make_client(tenants=tenants(max_concurrent_requests=1))
        submitted = await client.post("/v1/requests", json={**CHAT, "kind": "chat"}, headers=auth("key-a"))
        req_id = (await submitted.json())["id"]
        assert (await client.post("/v1/requests", json={**CHAT, "kind": "chat"},
                                  headers=auth("key-a"))).status == 429
        assert (await client.delete(f"/v1/requests/{req_id}", headers=auth("key-a"))).status == 200
        assert redis_server.client().zcard(KEYS.tenant_leases("team-a")) == 0
        assert (await client.post("/v1/requests", json={**CHAT, "kind": "chat"},
                                  headers=auth("key-a"))).status == 202


async def test_batch_lines_in_flight_are_capped_per_tenant_over_all_its_jobs(make_client, redis_server,
                                                                             tokenizer):
    plain = redis_server.client()
    line = {"method": "POST", "url": "/v1/chat/completions", "body": CHAT}
    lines = "\n".join(json.dumps({**line, "custom_id": f"c{i}"}) for i in range(10))
    with FakeScheduler(redis_server.url, MODEL, tokenizer, consume=False):  # alive, takes nothing
        await make_client(tenants=tenants(max_batch_lines_in_flight=3), batch_lease_s=2.0)
        for job_id in ("job-1", "job-2"):
            plain.xadd(KEYS.batch_in, {"job_id": job_id, "model": MODEL, "lines": lines, "tenant": "team-a"})
        plain.xadd(KEYS.batch_in, {"job_id": "job-3", "model": MODEL, "lines": lines})  # nobody's: no cap
        stream = KEYS.request_stream(MODEL, "batch", "team-a")
        for _ in range(200):
            if plain.xlen(KEYS.request_stream(MODEL, "batch")) == 10 and plain.xlen(stream) >= 3:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the feeder had its chance to queue more
        assert plain.xlen(stream) == 3  # team-a's two jobs together
        assert plain.xlen(KEYS.request_stream(MODEL, "batch")) == 10
        assert plain.sismember(KEYS.tenants(MODEL), "team-a")
        jobs = [plain.hgetall(KEYS.batch_job(j)) for j in ("job-1", "job-2")]
        assert [job[b"tenant"] for job in jobs] == [b"team-a", b"team-a"]


async def test_tenants_kept_in_redis_are_served_and_limited(make_client, fake_scheduler, redis_server,
                                                             capsys):
    from tokenfleet.cli import main

    url = ["--redis-url", redis_server.url]
    assert main(["tenants", "set", "team-r", "--key", "key-r", "--requests-per-minute", "1", *url]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown == {"tenant": "team-r", "limits": {"requests_per_minute": 1}, "num_keys": 1, "in_flight": 0}
    client = await make_client(tenants_from_redis=True)
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=auth("key-r"))).status == 200
    refused = await client.post("/v1/chat/completions", json=CHAT, headers=auth("key-r"))
    assert refused.status == 429 and (await refused.json())["error"]["code"] == "requests_per_minute"
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=auth("key-x"))).status == 401
    assert fake_scheduler.seen[-1].tenant == "team-r"
    assert main(["tenants", "remove", "team-r", *url]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["keys_removed"] == 1  # (after log lines)
    assert main(["tenants", "show", "team-r", *url]) == 1
    assert "no tenant 'team-r'" in capsys.readouterr().err


async def test_a_queued_requests_lease_outlives_the_lease_sets_first_ttl(make_client, redis_server,
                                                                         tokenizer):
    """A lease lasts until its request ends or its own term lapses, however old the lease set is:
    the set taken for the short pending lease (1 s here) must not expire with renewed leases in it."""
    leases = KEYS.tenant_leases("team-a")
    plain = redis_server.client()
    submit = {**CHAT, "kind": "chat"}
    with FakeScheduler(redis_server.url, MODEL, tokenizer, consume=False):  # alive, takes nothing
        client = await make_client(tenants=tenants(max_concurrent_requests=2), tenant_pending_lease_s=1.0,
                                   tenant_lease_s=6.0)
        ids = []
        for _ in range(2):
            response = await client.post("/v1/requests", json=submit, headers=auth("key-a"))
            assert response.status == 202
            ids.append((await response.json())["id"])
        # Past the set's first TTL (pending lease + 1 s): both requests still hold their leases.
        await asyncio.sleep(2.5)
        assert plain.zcard(leases) == 2
        for _ in range(2):
            refused = await client.post("/v1/requests", json=submit, headers=auth("key-a"))
            assert refused.status == 429
            assert (await refused.json())["error"]["code"] == "max_concurrent_requests"
        # A request that ends ends its lease; the new one's (short) lease leaves the others' TTL alone.
        assert (await client.delete(f"/v1/requests/{ids[0]}", headers=auth("key-a"))).status == 200
        assert (await client.post("/v1/requests", json=submit, headers=auth("key-a"))).status == 202
        assert plain.pttl(leases) / 1000 >= plain.zscore(leases, ids[1]) - time.time()
        await asyncio.sleep(2.5)
        assert plain.zcard(leases) == 2
        assert (await client.post("/v1/requests", json=submit, headers=auth("key-a"))).status == 429
        # A lease nobody ends lapses after its own term (6 s from its queueing).
        for _ in range(200):
            if (await client.post("/v1/requests", json=submit, headers=auth("key-a"))).status == 202:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the leases never lapsed")
        assert plain.zscore(leases, ids[1]) is None


async def test_a_call_without_max_tokens_is_charged_an_estimate_and_settled_on_its_use(
        make_client, redis_server, tokenizer):
    """tokens_per_minute below the context window: an SDK call without max_tokens is admitted
    (charged the prompt and an estimate, not the window), then charged what it really used:
    the unused estimate refunded, or the tokens past it charged."""
    plain = {**CHAT}
    del plain["max_tokens"]
    with FakeScheduler(redis_server.url, MODEL, tokenizer, max_reply_tokens=4):
        probe = await make_client(api_keys=("plain",))
        reply = await (await probe.post("/v1/chat/completions", json=plain, headers=auth("plain"))).json()
        prompt = reply["usage"]["prompt_tokens"]
        assert reply["usage"]["completion_tokens"] == 4
        # Two calls fit only if the first one's unused estimate came back.
        limit = 2 * (prompt + OUTPUT_ESTIMATE_TOKENS) - 50
        client = await make_client(tenants=tenants(tokens_per_minute=limit))
        for _ in range(2):
            response = await client.post("/v1/chat/completions", json=plain, headers=auth("key-a"))
            assert response.status == 200, await response.text()
    with FakeScheduler(redis_server.url, MODEL, tokenizer, max_reply_tokens=OUTPUT_ESTIMATE_TOKENS + 94):
        # A call that used more than its estimate is charged the rest: the next one no longer fits.
        limit = (prompt + OUTPUT_ESTIMATE_TOKENS + 94) + (prompt + OUTPUT_ESTIMATE_TOKENS) - 30
        client = await make_client(tenants=tenants(tokens_per_minute=limit))
        first = await client.post("/v1/chat/completions", json=plain, headers=auth("key-a"))
        assert (await first.json())["usage"]["completion_tokens"] == OUTPUT_ESTIMATE_TOKENS + 94
        second = await client.post("/v1/chat/completions", json=plain, headers=auth("key-a"))
        assert second.status == 429 and (await second.json())["error"]["code"] == "tokens_per_minute"
