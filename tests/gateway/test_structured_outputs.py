"""Structured outputs and tool calling with the official `openai` SDK against a real fleet: a
real Redis, a real scheduler (SchedulerService + LLMEngine on SmolLM2-135M, CPU) and the
gateway. The grammar, not the model, is what makes every answer fit: these hold even for a
135M model."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

import openai
import pytest
import pytest_asyncio
from pydantic import BaseModel, Field

from tests.gateway.conftest import MODEL

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]


class CityFact(BaseModel):
    # Bounded strings: the answer has an end the grammar can reach within max_tokens.
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)
    is_capital: bool
    size: Literal["small", "medium", "large"]


CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Delhi", "Sydney", "Toronto", "Madrid",
          "Nairobi", "Seoul", "Dublin", "Hanoi", "Quito", "Vienna", "Manila", "Santiago", "Athens", "Dakar"]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                       "required": ["city"], "additionalProperties": False},
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "description": "The local time in a city.",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                                "required": ["city"], "additionalProperties": False}},
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
BAD_SCHEMA = {"type": "object", "properties": {"city": {"type": "strin"}}}


@pytest_asyncio.fixture
async def sdk(real_client):
    client = await real_client()
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    yield sdk
    await sdk.close()


async def test_parse_returns_a_valid_instance_for_20_different_prompts(sdk):
    async def ask(city: str):
        return await sdk.chat.completions.parse(
            model=MODEL, max_tokens=96, temperature=0.7, seed=len(city), response_format=CityFact,
            messages=[{"role": "user", "content": f"Give facts about {city} as JSON."}])

    answers = await asyncio.gather(*(ask(city) for city in CITIES))
    facts = [answer.choices[0].message.parsed for answer in answers]
    assert all(isinstance(fact, CityFact) for fact in facts)  # 20 of 20: parse() validated each
    assert all(answer.choices[0].finish_reason == "stop" for answer in answers)
    texts = [answer.choices[0].message.content for answer in answers]
    assert len(set(texts)) > 1  # different prompts, different answers


async def test_json_object_mode_answers_json(sdk):
    answer = await sdk.chat.completions.create(
        model=MODEL, max_tokens=48, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat in JSON."}])
    text = answer.choices[0].message.content
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix of JSON
        assert text.lstrip().startswith("{")


async def test_a_tool_round_trip_tools_then_calls_then_a_tool_message_then_the_answer(sdk):
    first = await sdk.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
        parallel_tool_calls=False, max_tokens=48, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)

    conversation = [*ASK_WEATHER, choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps({"city": arguments["city"], "temperature_c": 21, "sky": "sunny"})}]
    second = await sdk.chat.completions.create(model=MODEL, messages=conversation, max_tokens=24,
                                               temperature=0, tools=[WEATHER_TOOL, TIME_TOOL])  # auto
    answer = second.choices[0].message
    assert answer.tool_calls is None and answer.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


async def test_a_named_tool_choice_calls_that_function(sdk):
    answer = await sdk.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=48, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = answer.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_time" for c in calls)
    assert all(set(json.loads(c.function.arguments)) == {"city"} for c in calls)


async def test_streamed_tool_call_deltas_are_reassembled_by_the_sdk(sdk):
    kwargs = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice="required",
                  parallel_tool_calls=False, max_tokens=48, temperature=0)
    whole = await sdk.chat.completions.create(**kwargs)
    kinds = set()
    async with sdk.chat.completions.stream(**kwargs) as stream:
        async for event in stream:
            kinds.add(event.type)
        final = await stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in kinds
    (streamed,) = final.choices[0].message.tool_calls
    (expected,) = whole.choices[0].message.tool_calls
    assert streamed.function.name == expected.function.name == "get_weather"
    assert json.loads(streamed.function.arguments) == json.loads(expected.function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"


async def test_an_invalid_schema_is_a_400_naming_it(sdk):
    with pytest.raises(openai.BadRequestError) as bad:
        await sdk.chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": BAD_SCHEMA}})
    assert bad.value.body["param"] == "response_format.json_schema.schema"
    assert "response_format.json_schema.schema" in bad.value.body["message"]
    assert "strin" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad_tool:
        await sdk.chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, max_tokens=8,
            tools=[{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}])
    assert bad_tool.value.body["param"] == "tools[0].function.parameters"
    with pytest.raises(openai.BadRequestError) as bad_choice:
        await sdk.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=8,
                                          tools=[WEATHER_TOOL],
                                          tool_choice={"type": "function", "function": {"name": "nope"}})
    assert bad_choice.value.body["param"] == "tool_choice"


async def test_the_same_in_a_batch_job(sdk):
    schema = {"name": "city_fact", "strict": True,
              "schema": openai.lib._pydantic.to_strict_json_schema(CityFact)}
    bodies = {
        "json": {"model": MODEL, "max_tokens": 96, "temperature": 0,
                 "response_format": {"type": "json_schema", "json_schema": schema},
                 "messages": [{"role": "user", "content": "Give facts about Paris as JSON."}]},
        "tool": {"model": MODEL, "max_tokens": 48, "temperature": 0, "tools": [WEATHER_TOOL],
                 "tool_choice": "required", "parallel_tool_calls": False, "messages": ASK_WEATHER},
        "bad": {"model": MODEL, "max_tokens": 8, "messages": ASK_WEATHER,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "bad", "schema": BAD_SCHEMA}}},
    }
    lines = [json.dumps({"custom_id": key, "method": "POST", "url": "/v1/chat/completions", "body": body})
             for key, body in bodies.items()]
    uploaded = await sdk.files.create(file=("job.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")
    deadline = time.monotonic() + 240
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.5)
        batch = await sdk.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    good = [json.loads(line) for line in (await sdk.files.content(batch.output_file_id)).text.splitlines()]
    bad = [json.loads(line) for line in (await sdk.files.content(batch.error_file_id)).text.splitlines()]
    by_id = {line["custom_id"]: line for line in good + bad}
    fact = by_id["json"]["response"]["body"]["choices"][0]["message"]["content"]
    CityFact.model_validate_json(fact)
    message = by_id["tool"]["response"]["body"]["choices"][0]["message"]
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])
    assert "response_format.json_schema.schema" in json.dumps(by_id["bad"])


async def test_submit_and_poll_answers_tool_calls_too(real_client):
    http = await real_client()
    body = {"kind": "chat", "model": MODEL, "messages": ASK_WEATHER, "tools": [WEATHER_TOOL],
            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 48, "temperature": 0}
    submitted = await http.post("/v1/requests", json=body)
    assert submitted.status == 202, await submitted.text()
    req_id = (await submitted.json())["id"]
    deadline = time.monotonic() + 120
    while (view := await (await http.get(f"/v1/requests/{req_id}")).json())["status"] != "completed":
        assert view["status"] in ("queued", "running") and time.monotonic() < deadline, view
        await asyncio.sleep(0.3)
    choice = view["result"]["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])
    assert choice["finish_reason"] == "tool_calls"
