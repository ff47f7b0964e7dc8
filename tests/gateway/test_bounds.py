"""Every list- and string-valued field of a generation request has a bound (gateway/api/openai/bounds.py):
a body past one is a 400 naming the field on chat, completions, /v1/requests and in a batch line,
and nothing of it reaches Redis (fake scheduler, real Redis)."""

from __future__ import annotations

import json

import pytest

from gateway.api.batch.lines import parse_line
from gateway.api.openai import bounds
from gateway.errors import BadRequest
from protocol.keys import Keys
from tests.gateway.conftest import MODEL

pytestmark = pytest.mark.asyncio

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
HUGE_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def tool(**function) -> dict:
    return {"type": "function", "function": {**TOOL["function"], **function}}


# (endpoint kind, body fields past a bound, the param the 400 names)
OVER = [
    ("chat", {"stop": [f"s{i}" for i in range(bounds.MAX_STOP_STRINGS + 1)]}, "stop"),
    ("chat", {"stop": "x" * (bounds.MAX_STOP_STRING_CHARS + 1)}, "stop"),
    ("chat", {"stop_token_ids": list(range(bounds.MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
    ("chat", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}] * (bounds.MAX_MESSAGES + 1)}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]
                            * (bounds.MAX_CONTENT_PARTS + 1)}]}, "messages[0]"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "name": "n" * (bounds.MAX_NAME_CHARS + 1)}]},
     "messages[0].name"),
    ("chat", {"tools": [tool(name=f"f{i}") for i in range(bounds.MAX_TOOLS + 1)]}, "tools"),
    ("chat", {"tools": [tool(parameters=HUGE_SCHEMA)]}, "tools[0].function.parameters"),
    ("chat", {"tools": [tool(description="d" * (bounds.MAX_DESCRIPTION_CHARS + 1))]},
     "tools[0].function.description"),
    ("chat", {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": HUGE_SCHEMA}}},
     "response_format.json_schema.schema"),
    ("chat", {"n": bounds.MAX_N + 1}, "n"),
    ("chat", {"seed": 2**63}, "seed"),
    ("chat", {"top_k": bounds.MAX_TOP_K + 1}, "top_k"),
    ("chat", {"user": "u" * (bounds.MAX_NAME_CHARS + 1)}, "user"),
    ("chat", {"model": "m" * (bounds.MAX_NAME_CHARS + 1)}, "model"),
    ("completion", {"prompt": ["p"] * (bounds.MAX_PROMPTS + 1)}, "prompt"),
    ("completion", {"prompt": [[1, 2]] * (bounds.MAX_PROMPTS + 1)}, "prompt"),
    ("completion", {"stop_token_ids": list(range(bounds.MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
    ("completion", {"stop": ["s"] * (bounds.MAX_STOP_STRINGS + 1)}, "stop"),
]
IDS = [f"{kind}-{param}-{i}" for i, (kind, _, param) in enumerate(OVER)]


@pytest.mark.parametrize(("kind", "fields", "param"), OVER, ids=IDS)
async def test_a_body_past_a_bound_is_a_400_naming_the_field(make_client, fake_scheduler, kind, fields,
                                                             param):
    client = await make_client()
    body = {**(CHAT if kind == "chat" else COMPLETION), **fields}
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    for route, sent in ((path, body), ("/v1/requests", {**body, "kind": kind})):
        response = await client.post(route, json=sent)
        assert response.status == 400, (route, await response.text())
        error = (await response.json())["error"]
        assert error["param"] == param, (route, error)
    url = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    with pytest.raises(BadRequest) as refused:
        parse_line(json.dumps({"custom_id": "c", "method": "POST", "url": url, "body": body}))
    assert refused.value.param == f"body.{param}"
    assert fake_scheduler.seen == []


async def test_a_body_at_every_bound_is_accepted(make_client, fake_scheduler):
    client = await make_client()
    body = {**CHAT, "stop": ["x" * bounds.MAX_STOP_STRING_CHARS] * bounds.MAX_STOP_STRINGS,
            "stop_token_ids": list(range(bounds.MAX_STOP_TOKEN_IDS)), "user": "u" * bounds.MAX_NAME_CHARS}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200, await response.text()
    assert fake_scheduler.seen[0].sampling["stop_token_ids"] == list(range(bounds.MAX_STOP_TOKEN_IDS))


async def test_a_million_and_a_half_stop_token_ids_are_refused_before_anything_is_queued(
        make_client, fake_scheduler, redis_server):
    client = await make_client()
    body = json.dumps({**CHAT, "n": 8, "stop_token_ids": [7] * 1_500_000}, separators=(",", ":"))
    assert len(body) > 3_000_000  # (under the 4 MiB body limit: the bound, not the size, refuses it)
    response = await client.post("/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    assert response.status == 400
    assert (await response.json())["error"]["param"] == "stop_token_ids"
    assert fake_scheduler.seen == []
    assert not list(redis_server.client().scan_iter(match=Keys().result("*")))  # no record made
