"""/health, /ready, /metrics, /v1/models, /openapi.json, request ids and the CLI command."""

from __future__ import annotations

import asyncio

import pytest

from gateway.routes import ROUTES
from tests.gateway.conftest import MODEL
from tokenfleet.cli import _list_value, build_parser

pytestmark = pytest.mark.asyncio

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


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


async def test_a_scheduler_of_a_model_the_gateway_does_not_front_is_not_listed(make_client, redis_server,
                                                                                tokenizer):
    from tests.gateway.fake_scheduler import FakeScheduler

    with FakeScheduler(redis_server.url, "other-model", tokenizer):
        client = await make_client()
        assert (await (await client.get("/v1/models")).json())["data"] == []
        assert (await client.get("/ready")).status == 503


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
