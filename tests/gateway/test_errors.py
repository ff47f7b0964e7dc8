"""Bad input gets a 4xx in OpenAI's error shape naming the field, never a 5xx; the gateway
answers 401 / 404 / 413 / 429 / 503 where it should (fake scheduler: no model runs)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.gateway.conftest import MODEL

pytestmark = pytest.mark.asyncio

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def assert_error(body: dict, param: str | None, error_type: str = "invalid_request_error") -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == error_type
    assert body["error"]["param"] == param, body
    assert body["error"]["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {**CHAT, "max_tokens": "5"}, "max_tokens"),  # strict: no "5" for 5
    ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 3}, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": "a"}, "frequency_penalty"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, "n"),
    ("/v1/chat/completions", {**CHAT, "n": 9}, "n"),  # over --max-n (8)
    ("/v1/chat/completions", {**CHAT, "seed": 1.5}, "seed"),
    ("/v1/chat/completions", {**CHAT, "stop": ["ok", ""]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "frobnicate": True}, "frobnicate"),  # unknown: rejected, not ignored
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"50": 10}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),  # no tools
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {
        "name": "nope"}}}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL, TOOL]}, "tools"),  # the same name twice
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}]},
     "tools[0].function.parameters"),
    ("/v1/chat/completions", {**CHAT, "functions": [TOOL["function"]]}, "functions"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/defs/nowhere"}}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0]"),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages[0]"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 9000}, "max_tokens"),  # past the context window
    ("/v1/chat/completions", {**CHAT, "max_tokens": None, "max_completion_tokens": 9000},
     "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 5}, "max_tokens"),  # both, different
    ("/v1/chat/completions", {k: v for k, v in CHAT.items() if k != "messages"}, "messages"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 2, 10**6]}, "prompt"),  # outside the vocabulary
    ("/v1/completions", {**COMPLETION, "prompt": [1] * 8200}, "prompt"),  # longer than the context
    ("/v1/completions", {**COMPLETION, "prompt": [-1]}, "prompt[0]"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["a"] * 17}, "prompt"),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "echo": True}, "echo"),  # vLLM's chat echo: not served
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
    ("/v1/completions", {**COMPLETION, "stream": True, "stream_options": {"continuous_usage_stats": 1}},
     "stream_options.continuous_usage_stats"),
    ("/v1/completions", {**COMPLETION, "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {**COMPLETION, "best_of": 3}, "best_of"),
    ("/v1/completions", {**COMPLETION, "suffix": "end"}, "suffix"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "top_k": -2}, "top_k"),
    ("/v1/completions", {**COMPLETION, "min_p": 1.5}, "min_p"),
    ("/v1/completions", {**COMPLETION, "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {**COMPLETION, "ignore_eos": "yes"}, "ignore_eos"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [-3]}, "stop_token_ids[0]"),
    ("/v1/completions", {**COMPLETION, "priority": 2**40}, "priority"),
    ("/v1/requests", {**CHAT, "kind": "chat", "stream": True}, "stream"),
    ("/v1/requests", {**CHAT, "kind": "chat", "n": 2}, "n"),
    ("/v1/requests", {**CHAT, "kind": "poem"}, "kind"),
    ("/v1/requests", CHAT, "kind"),
    ("/v1/requests", {**COMPLETION, "kind": "completion", "timeout": -1}, "timeout"),
    ("/v1/requests", {**COMPLETION, "kind": "completion", "messages": []}, "messages"),
])
async def test_bad_parameter_is_a_400_naming_it(make_client, fake_scheduler, path, body, param):
    client = await make_client()
    response = await client.post(path, json=body)
    assert response.status == 400, await response.text()
    assert_error(await response.json(), param)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"null", b'{"model": NaN}', b"\xff\xfe"])
async def test_malformed_body_is_a_400(make_client, fake_scheduler, raw):
    client = await make_client()
    headers = {"Content-Type": "application/json"}
    response = await client.post("/v1/chat/completions", data=raw, headers=headers)
    assert response.status == 400
    assert (await response.json())["error"]["type"] == "invalid_request_error"


async def test_unknown_model_is_a_404_model_not_found(make_client, fake_scheduler):
    client = await make_client()
    response = await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
    assert response.status == 404
    body = await response.json()
    assert_error(body, "model")
    assert body["error"]["code"] == "model_not_found"


async def test_unknown_route_and_method_answer_in_openai_shape(make_client):
    client = await make_client()
    response = await client.get("/v1/nothing")
    assert response.status == 404
    assert_error(await response.json(), None)
    response = await client.get("/v1/chat/completions")
    assert response.status == 405
    assert_error(await response.json(), None)


async def test_body_over_the_limit_is_a_413(make_client, fake_scheduler):
    client = await make_client(max_body_bytes=1000)
    response = await client.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 2000})
    assert response.status == 413
    assert_error(await response.json(), None)


async def test_api_keys_guard_everything_but_the_probes_and_the_description(make_client, fake_scheduler):
    client = await make_client(api_keys=("k1", "k2"))
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 401
    wrong = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"})
    assert wrong.status == 401
    assert_error(await wrong.json(), None, "authentication_error")
    right = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer k2"})
    assert right.status == 200
    assert (await client.get("/v1/models")).status == 401
    for path in ("/health", "/ready", "/openapi.json", "/"):
        assert (await client.get(path)).status == 200, path
    for path in ("/metrics", "/fleet.json"):  # they name hosts, pids, jobs and errors
        assert (await client.get(path)).status == 401, path
        assert (await client.get(path, headers={"Authorization": "Bearer nope"})).status == 401, path
        assert (await client.get(path, headers={"Authorization": "Bearer k1"})).status == 200, path


async def test_public_metrics_opens_the_fleet_views_and_only_them(make_client, fake_scheduler):
    client = await make_client(api_keys=("k1",), public_metrics=True)
    for path in ("/metrics", "/fleet.json"):
        assert (await client.get(path)).status == 200, path
    assert (await client.get("/v1/models")).status == 401
    document = await (await client.get("/openapi.json")).json()
    assert document["paths"]["/metrics"]["get"]["security"] == []


async def test_no_live_scheduler_is_a_503(make_client):
    client = await make_client()
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status == 503
    assert "Retry-After" in response.headers
    body = await response.json()
    assert body["error"]["code"] == "no_scheduler"
    assert (await client.get("/ready")).status == 503
    assert (await (await client.get("/v1/models")).json())["data"] == []


async def test_redis_unreachable_is_a_503_and_its_return_is_taken_up(make_client, redis_server,
                                                                     fake_scheduler):
    client = await make_client()
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    redis_server.stop()
    try:
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status == 503
        assert (await response.json())["error"]["code"] in ("redis_unavailable", "no_scheduler")
        ready = await client.get("/ready")
        assert ready.status == 503
        assert (await ready.json())["redis"] is False
        assert (await client.get("/health")).status == 200
    finally:
        redis_server.start()
    # Redis is back: the gateway's pub/sub connection comes back by itself, and streams work again.
    for _ in range(100):
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        if response.status == 200:
            break
        await asyncio.sleep(0.1)
    text = await response.text()
    assert response.status == 200 and " fox" in text and text.rstrip().endswith("[DONE]")


async def test_full_queue_is_a_429_with_retry_after(make_client, redis_server, tokenizer):
    from tests.gateway.fake_scheduler import FakeScheduler

    with FakeScheduler(redis_server.url, MODEL, tokenizer, consume=False):  # alive, takes nothing
        client = await make_client(max_queue=2)
        for _ in range(2):
            assert (await client.post("/v1/requests", json={**CHAT, "kind": "chat"})).status == 202
        response = await client.post("/v1/requests", json={**CHAT, "kind": "chat"})
        assert response.status == 429
        assert response.headers["Retry-After"] == "1"
        assert_error(await response.json(), None, "rate_limit_error")
        stream = await client.post("/v1/chat/completions", json={**CHAT, "n": 1})
        assert stream.status == 429


async def test_openai_sdk_raises_its_own_errors(make_client, fake_scheduler):
    client = await make_client(api_keys=("secret",))
    base_url = str(client.make_url("/v1"))
    sdk = openai.AsyncOpenAI(base_url=base_url, api_key="secret", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        await sdk.chat.completions.create(model=MODEL, messages=CHAT["messages"], top_p=2.0)
    assert bad.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        await sdk.chat.completions.create(model="nope", messages=CHAT["messages"])
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    await sdk.close()


async def test_error_bodies_are_json_even_for_huge_or_odd_inputs(make_client, fake_scheduler):
    client = await make_client()
    odd = [{"messages": "hi"}, {"messages": [{"role": "user", "content": {"a": 1}}]},
           {**CHAT, "stop": 5}, {**CHAT, "seed": 2**64}, {**CHAT, "n": True}]
    for body in odd:
        response = await client.post("/v1/chat/completions", data=json.dumps(body))
        assert response.status == 400, (body, await response.text())
        assert "error" in await response.json()
