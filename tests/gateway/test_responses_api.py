"""/v1/responses with the official `openai` SDK against a real gateway and a real Redis, the
fleet played by the fake scheduler (a fixed reply, one token per event): plain, streamed,
background then retrieved, cancelled, chained by previous_response_id, a stream resumed with
starting_after (no gap, no repeat), deleted, input_items; another tenant's response is a 404;
every feature we do not serve is a 400 naming its field."""

from __future__ import annotations

import asyncio

import openai
import pytest
import pytest_asyncio

from tests.gateway.conftest import MODEL
from tests.gateway.fake_scheduler import REPLY, FakeScheduler
from tests.gateway.test_tenant_isolation import auth, tenants

pytestmark = pytest.mark.asyncio


@pytest.fixture
def fake_scheduler(redis_server, tokenizer):
    """The reply once, ending as a model's answer ends ("stop")."""
    with FakeScheduler(redis_server.url, MODEL, tokenizer, stop_after_reply=True) as fake:
        yield fake


@pytest_asyncio.fixture
async def gateway(make_client):
    return await make_client()


def sdk_of(client, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0)


@pytest_asyncio.fixture
async def sdk(gateway):
    sdk = sdk_of(gateway)
    yield sdk
    await sdk.close()


async def wait_done(sdk, response_id: str):
    for _ in range(600):
        response = await sdk.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress"):
            return response
        await asyncio.sleep(0.05)
    raise AssertionError(f"{response_id} is still {response.status}")


async def raw_events(client, path: str) -> list[dict]:
    """The SSE events of a GET stream, parsed (data lines only)."""
    import json

    response = await client.get(path)
    assert response.status == 200, await response.text()
    text = await response.text()
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


async def test_a_plain_response_is_the_reply_as_one_message(sdk, fake_scheduler):
    response = await sdk.responses.create(model=MODEL, input="Hello", metadata={"run": "1"})
    assert response.status == "completed"
    assert response.id.startswith("resp_")
    assert response.output_text == REPLY
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert response.usage.output_tokens == len(fake_scheduler.reply_ids)
    assert response.usage.input_tokens > 0
    assert response.metadata == {"run": "1"}
    again = await sdk.responses.retrieve(response.id)
    assert again.model_dump() == response.model_dump()  # rebuilt from Redis, the same


async def test_max_output_tokens_makes_it_incomplete(sdk, fake_scheduler):
    response = await sdk.responses.create(model=MODEL, input="Hello", max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


async def test_a_streamed_response_has_every_event_type_in_order_numbered_from_zero(sdk, fake_scheduler):
    stream = await sdk.responses.create(model=MODEL, input="Hello", stream=True)
    events = [event async for event in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == REPLY
    final = events[-1].response
    assert final.output_text == REPLY
    stored = await sdk.responses.retrieve(final.id)
    assert stored.model_dump() == final.model_dump()


async def test_a_background_response_runs_without_its_client_and_is_retrieved(sdk, fake_scheduler):
    response = await sdk.responses.create(model=MODEL, input="Hello", background=True)
    assert response.status == "queued" and response.background is True
    done = await wait_done(sdk, response.id)
    assert done.status == "completed" and done.output_text == REPLY


async def test_a_queued_background_response_is_cancelled(gateway, sdk, redis_server, tokenizer):
    with FakeScheduler(redis_server.url, MODEL, tokenizer, consume=False):  # alive, takes nothing
        response = await sdk.responses.create(model=MODEL, input="Hello", background=True)
        cancelled = await sdk.responses.cancel(response.id)
        assert cancelled.status == "cancelled" and cancelled.output_text == ""
        assert (await sdk.responses.cancel(response.id)).status == "cancelled"  # a no-op once ended


async def test_a_running_background_response_is_cancelled_mid_generation(gateway, sdk, redis_server,
                                                                         tokenizer):
    with FakeScheduler(redis_server.url, MODEL, tokenizer, stop_after_reply=True, token_delay_s=0.5):
        response = await sdk.responses.create(model=MODEL, input="Hello", background=True)
        while not response.output_text:
            response = await sdk.responses.retrieve(response.id)
            await asyncio.sleep(0.05)
        assert response.status == "in_progress"
        cancelled = await sdk.responses.cancel(response.id)
        if cancelled.status != "cancelled":  # (the cancel waits cancel_wait_s only)
            cancelled = await wait_done(sdk, response.id)
        assert cancelled.status == "cancelled"
        assert cancelled.output_text and REPLY.startswith(cancelled.output_text)
        assert len(cancelled.output_text) < len(REPLY)


async def test_only_a_background_response_can_be_cancelled(sdk, fake_scheduler):
    response = await sdk.responses.create(model=MODEL, input="Hello")
    with pytest.raises(openai.BadRequestError, match="only background responses"):
        await sdk.responses.cancel(response.id)


async def test_a_resumed_stream_has_no_gap_and_no_repeat(gateway, sdk, redis_server, tokenizer):
    with FakeScheduler(redis_server.url, MODEL, tokenizer, stop_after_reply=True, token_delay_s=0.02):
        stream = await sdk.responses.create(model=MODEL, input="Hello", background=True, stream=True)
        seen = []
        async for event in stream:
            seen.append(event)
            if event.type == "response.output_text.delta" and len(seen) > 6:
                break
        await stream.close()  # the client leaves mid-stream; a background response runs on
        last = seen[-1].sequence_number
        path = f"/v1/responses/{seen[0].response.id}?stream=true"
        rest = await raw_events(gateway, f"{path}&starting_after={last}")
        whole = await raw_events(gateway, path)
    numbers = [e.sequence_number for e in seen] + [e["sequence_number"] for e in rest]
    assert numbers == list(range(len(numbers)))
    assert [(e.type, getattr(e, "delta", None)) for e in seen] == [
        (e["type"], e.get("delta")) for e in whole[:len(seen)]]  # a rebuild numbers them the same
    assert [e["sequence_number"] for e in whole] == numbers
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta") + \
        "".join(e["delta"] for e in rest if e["type"] == "response.output_text.delta")
    assert text == REPLY
    assert rest[-1]["type"] == "response.completed"
    assert rest[-1] == whole[-1]


async def test_chaining_gives_the_previous_input_and_output_as_context(gateway, sdk, fake_scheduler):
    first = await sdk.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.")
    second = await sdk.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 8
    items = await sdk.responses.input_items.list(second.id, order="asc")
    kinds = [(item.type, item.role, item.content[0].text) for item in items.data]
    assert kinds == [("message", "user", "My name is Ada."), ("message", "assistant", REPLY),
                     ("message", "user", "What is my name?")]
    newest = await sdk.responses.input_items.list(second.id, limit=1)
    assert newest.data[0].content[0].text == "What is my name?" and newest.has_more


async def test_a_function_call_output_answers_a_call_across_turns(sdk, fake_scheduler):
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}
    first = await sdk.responses.create(model=MODEL, input="Weather in Paris?", tools=[tool])
    # (the fake scheduler's reply is no call: the text comes back as a message)
    assert first.output_text == REPLY and first.tools[0].name == "get_weather"
    second = await sdk.responses.create(model=MODEL, tools=[tool], previous_response_id=first.id, input=[
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert second.status == "completed"
    items = await sdk.responses.input_items.list(second.id, order="asc")
    assert [item.type for item in items.data] == ["message", "message", "function_call",
                                                  "function_call_output"]


async def test_a_deleted_response_is_gone(sdk, fake_scheduler):
    response = await sdk.responses.create(model=MODEL, input="Hello")
    await sdk.responses.delete(response.id)  # (the SDK returns nothing)
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.delete(response.id)


async def test_an_unstored_response_cannot_be_retrieved(sdk, fake_scheduler):
    response = await sdk.responses.create(model=MODEL, input="Hello", store=False)
    assert response.output_text == REPLY
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve(response.id)


async def test_another_tenants_response_is_a_404(make_client, fake_scheduler):
    client = await make_client(tenants=tenants())
    a, b = sdk_of(client, "key-a"), sdk_of(client, "key-b")
    try:
        response = await a.responses.create(model=MODEL, input="Hello", background=True)
        assert (await wait_done(a, response.id)).output_text == REPLY
        for call in (lambda: b.responses.retrieve(response.id), lambda: b.responses.cancel(response.id),
                     lambda: b.responses.delete(response.id),
                     lambda: b.responses.input_items.list(response.id),
                     lambda: b.responses.create(model=MODEL, input="x", previous_response_id=response.id)):
            with pytest.raises(openai.NotFoundError):
                await call()
        stream = await client.get(f"/v1/responses/{response.id}?stream=true", headers=auth("key-b"))
        assert stream.status == 404
        assert (await a.responses.retrieve(response.id)).output_text == REPLY  # its owner still sees it
    finally:
        await a.close()
        await b.close()


UNSUPPORTED = [
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options"),
    ({"seed": 1}, "seed"),
    ({"background": True, "store": False}, "store"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
    ({"tools": [{"type": "computer_use_preview", "display_width": 1, "display_height": 1,
                 "environment": "linux"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "web_search_call", "id": "ws_1"}]},
     "input[1].type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}},
     "text.format.schema"),
    ({"text": {"verbosity": "high"}}, "text.verbosity"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
]


@pytest.mark.parametrize(("fields", "param"), UNSUPPORTED, ids=[param for _, param in UNSUPPORTED])
async def test_each_unsupported_feature_is_a_400_naming_its_field(gateway, fields, param):
    body = {"model": MODEL, "input": "Hello", **fields}
    response = await gateway.post("/v1/responses", json=body)
    error = (await response.json())["error"]
    assert response.status == 400, error
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


async def test_an_unknown_response_is_a_404(gateway):
    for path in ("/v1/responses/resp_" + "0" * 32, "/v1/responses/nope", "/v1/responses/resp_" + "0" * 32
                 + "/input_items"):
        assert (await gateway.get(path)).status == 404


async def test_a_limit_that_is_not_a_plain_number_is_a_400_naming_it(gateway, sdk, fake_scheduler):
    response = await sdk.responses.create(model=MODEL, input="Hello")
    for limit in ("0", "101", "x", "²"):  # ("²".isdigit() is true, int("²") raises)
        answer = await gateway.get(f"/v1/responses/{response.id}/input_items", params={"limit": limit})
        assert answer.status == 400 and (await answer.json())["error"]["param"] == "limit"
