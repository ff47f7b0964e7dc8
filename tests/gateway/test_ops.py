"""/health, /ready, /metrics, /v1/models, /openapi.json, request ids and the CLI command."""

from __future__ import annotations

import asyncio

import pytest

from gateway.http.routes import ROUTES
from tests.gateway.conftest import MODEL
from tokenfleet.cli import _list_value, build_parser

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.asyncio
async def test_ready_and_models_follow_live_schedulers(make_client, redis_server, tokenizer):
    from tests.gateway.fake_scheduler import FakeScheduler

    client = await make_client(scheduler_grace_s=0.3)
    assert (await client.get("/health")).status == 200
    assert (await client.get("/ready")).status == 503
    with FakeScheduler(redis_server.url, MODEL, tokenizer):
        ready = await client.get("/ready")
        assert ready.status == 200
        assert (await ready.json())["models"] == [MODEL]
        models = await (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert models["data"][0]["max_model_len"] == 8192
        assert (await client.get(f"/v1/models/{MODEL}")).status == 200
    # The heartbeat is gone: after the grace period nothing is served any more.
    await asyncio.sleep(0.4)
    assert (await (await client.get("/v1/models")).json())["data"] == []
    assert (await client.get(f"/v1/models/{MODEL}")).status == 404


@pytest.mark.asyncio
async def test_a_scheduler_of_a_model_the_gateway_does_not_front_is_not_listed(make_client, redis_server,
                                                                                tokenizer):
    from tests.gateway.fake_scheduler import FakeScheduler

    with FakeScheduler(redis_server.url, "other-model", tokenizer):
        client = await make_client()
        assert (await (await client.get("/v1/models")).json())["data"] == []
        assert (await client.get("/ready")).status == 503


@pytest.mark.asyncio
async def test_metrics_are_prometheus_text_with_the_promised_series(make_client, fake_scheduler):
    client = await make_client()
    assert (await client.post("/v1/chat/completions", json={**CHAT, "stream": True})).status == 200
    assert (await client.post("/v1/chat/completions", json={**CHAT, "top_p": 7})).status == 400
    for _ in range(50):  # the queue time is observed in the background, after the answer
        response = await client.get("/metrics")
        text = await response.text()
        if "tokenfleet_gateway_queue_time_seconds_bucket" in text:
            break
        await asyncio.sleep(0.02)
    assert response.headers["Content-Type"].startswith("text/plain")
    for name in ("http_requests_total", "requests_total", "queue_time_seconds_bucket",
                 "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "active_streams", "queue_depth", "live_schedulers"):
        assert f"tokenfleet_gateway_{name}" in text, name
    assert 'route="/v1/chat/completions",status="400"' in text
    assert f'tokenfleet_gateway_requests_total{{model="{MODEL}",status="completed"}} 1.0' in text


@pytest.mark.asyncio
async def test_openapi_describes_every_route(make_client):
    client = await make_client()
    document = await (await client.get("/openapi.json")).json()
    for route in ROUTES:
        assert route.method.lower() in document["paths"][route.path], route.path
    chat = document["paths"]["/v1/chat/completions"]["post"]
    body_schema = chat["requestBody"]["content"]["application/json"]["schema"]
    assert body_schema["$ref"].endswith("ChatCompletionRequest")
    assert "top_k" in document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert "security" not in document  # no API key configured


def test_openapi_says_the_fleet_views_need_a_key_as_the_gateway_does():
    from gateway.http.openapi import openapi_document

    def access(**config) -> dict:
        paths = openapi_document(**config)["paths"]
        return {path: paths[path]["get"] for path in ("/metrics", "/fleet.json", "/ready")}

    for path, op in access(secured=True, tenants=True).items():
        if path == "/ready":
            assert op["security"] == []
            continue
        assert op["security"] == [{"bearer": []}] and "admin tenant" in op["description"], path
        assert {"401", "403"} <= set(op["responses"]), path
    keys_only = access(secured=True)
    assert keys_only["/metrics"]["security"] == [{"bearer": []}]
    assert "403" not in keys_only["/metrics"]["responses"]
    assert access(secured=True, tenants=True, public_views=True)["/fleet.json"]["security"] == []
    assert "security" not in access(secured=False)["/metrics"]  # an open gateway: nothing to say


@pytest.mark.asyncio
async def test_request_ids_come_back_and_sane_client_ones_are_kept(make_client):
    client = await make_client()
    mine = await client.get("/health", headers={"X-Request-Id": "abc-123"})
    assert mine.headers["X-Request-Id"] == "abc-123"
    odd = await client.get("/health", headers={"X-Request-Id": "bad id\twith spaces"})
    assert len(odd.headers["X-Request-Id"]) == 32


def test_gateway_command_flags_repeat_and_come_from_the_environment(monkeypatch):
    args = build_parser().parse_args([
        "gateway", "--redis-url", "redis://h:1/0", "--port", "9000", "--model", "/m/a", "--model", "/m/b",
        "--model-name", "a", "--api-key", "k1", "--api-key", "k2", "--max-queue", "5", "--max-n", "2"])
    assert (args.redis_url, args.port, args.max_queue, args.max_n) == ("redis://h:1/0", 9000, 5, 2)
    assert _list_value(args, "model") == ["/m/a", "/m/b"]
    assert _list_value(args, "api-key") == ["k1", "k2"]
    monkeypatch.setenv("TOKENFLEET_API_KEY", "x, y")
    monkeypatch.setenv("TOKENFLEET_MAX_N", "3")
    monkeypatch.setenv("TOKENFLEET_HOST", "0.0.0.0")
    args = build_parser().parse_args(["gateway"])
    assert _list_value(args, "api-key") == ["x", "y"]
    assert (args.max_n, args.host, args.port) == (3, "0.0.0.0", 8000)


async def _requests_total(client, status: str) -> float:
    text = await (await client.get("/metrics")).text()
    prefix = f'tokenfleet_gateway_requests_total{{model="{MODEL}",status="{status}"}} '
    return next((float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


async def _wait_for_count(client, status: str, expected: float) -> None:
    for _ in range(250):
        if await _requests_total(client, status) == expected:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"requests_total{{status={status!r}}} is {await _requests_total(client, status)}, "
                         f"not {expected}")


@pytest.mark.asyncio
async def test_requests_total_counts_every_end(make_client, redis_server, tokenizer):
    import aiohttp

    from tests.gateway.fake_scheduler import FakeScheduler

    client = await make_client(max_queue=1)
    with FakeScheduler(redis_server.url, MODEL, tokenizer, consume=False):  # alive, takes nothing
        queued = await client.post("/v1/requests", json={**CHAT, "kind": "chat"})
        assert queued.status == 202
        assert (await client.post("/v1/chat/completions", json=CHAT)).status == 429
        await _wait_for_count(client, "rejected", 1)
    with FakeScheduler(redis_server.url, MODEL, tokenizer, token_delay_s=0.05):
        location = f"/v1/requests/{(await queued.json())['id']}"
        while (await (await client.get(location)).json())["status"] != "completed":  # the queue is empty
            await asyncio.sleep(0.02)
        assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
        await _wait_for_count(client, "completed", 1)
        # Cancelled through /v1/requests while the call follows it: the call sees its end.
        call = asyncio.ensure_future(client.post("/v1/chat/completions",
                                                 json={**CHAT, "max_tokens": 500, "stream": True}))
        keys = []
        while not keys:
            keys = redis_server.client().keys("tf:res:*")
            keys = [k for k in keys if redis_server.client().hget(k, "state") == b"running"]
            await asyncio.sleep(0.02)
        req_id = keys[0].decode().rpartition(":")[2]
        assert (await client.delete(f"/v1/requests/{req_id}")).status == 200
        await (await call).text()
        await _wait_for_count(client, "cancelled", 1)
        # The client leaves, streaming and waiting.
        url = client.make_url("/v1/chat/completions")
        async with aiohttp.ClientSession() as session:
            response = await session.post(url, json={**CHAT, "max_tokens": 500, "stream": True})
            for _ in range(3):
                await response.content.readline()
            response.close()
            await _wait_for_count(client, "disconnected", 1)
            waiting = asyncio.ensure_future(session.post(url, json={**CHAT, "max_tokens": 500}))
            await asyncio.sleep(0.5)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await _wait_for_count(client, "disconnected", 2)
    assert await _requests_total(client, "completed") == 1
