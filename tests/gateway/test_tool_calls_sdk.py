"""Tool calls shaped as OpenAI's, with the official `openai` SDK against a real gateway, a real
Redis and a real SmolLM2 scheduler (CPU): named, required and auto tool_choice, streamed and
not; arguments exactly as generated; an echoed assistant message accepted; compact JSON."""

from __future__ import annotations

import json

import openai
import pytest
import pytest_asyncio

from tests.gateway.conftest import MODEL
from tests.gateway.test_structured_outputs import ASK_WEATHER, TIME_TOOL

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

# No bounds on the strings and a free `unit`: the grammar, not the schema, must end the answer.
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest_asyncio.fixture
async def sdk(real_client):
    client = await real_client()
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    sdk.http = client
    yield sdk
    await sdk.close()


def generated_text(choice) -> str:
    """What the model wrote, token by token (logprobs carry every token)."""
    return "".join(item.token for item in choice.logprobs.content)


def assert_calls_as_generated(choice) -> None:
    text = generated_text(choice)
    for call in choice.message.tool_calls:
        json.loads(call.function.arguments)
        assert "\n" not in call.function.arguments  # compact JSON
        # Byte-identical to the generated text of the arguments object.
        assert f'"name": "{call.function.name}", "arguments": {call.function.arguments}}}' in text


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
async def test_a_forced_choice_ends_with_complete_calls_and_finish_reason_tool_calls(sdk, tool_choice):
    reply = await sdk.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice=tool_choice, max_tokens=400,
        temperature=0, logprobs=True)
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(call.id.startswith("call_") for call in calls)
    if tool_choice == NAMED:
        (call,) = calls  # a named choice is exactly one call
        assert call.function.name == "get_weather"
    assert_calls_as_generated(choice)


async def test_parallel_tool_calls_false_makes_at_most_one_call(sdk):
    reply = await sdk.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=200, temperature=0, logprobs=True)
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_calls_as_generated(choice)


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
async def test_a_streamed_forced_choice_gives_the_sdk_the_same_message_with_content_null(sdk, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice=tool_choice, max_tokens=400,
                  temperature=0)
    whole = await sdk.chat.completions.create(**kwargs)
    async with sdk.chat.completions.stream(**kwargs) as stream:
        final = await stream.get_final_completion()
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    streamed = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]


async def test_auto_answers_text_or_calls_with_the_text_outside_them_as_content(sdk):
    reply = await sdk.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=64,
                                              temperature=0, logprobs=True)
    (choice,) = reply.choices
    text = generated_text(choice)
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        assert "<tool_call>" not in (choice.message.content or "")
        assert_calls_as_generated(choice)
    else:
        assert choice.message.content == text
    stream = await sdk.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=64,
                                               temperature=0, stream=True)
    content, arguments, finish = None, [], None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        if delta.content is not None:
            content = (content or "") + delta.content
        arguments += [c.function.arguments for c in delta.tool_calls or [] if c.function.arguments]
        finish = chunk.choices[0].finish_reason or finish
    assert content == choice.message.content
    assert arguments == [c.function.arguments for c in choice.message.tool_calls or []]
    assert finish == choice.finish_reason


async def test_an_echoed_assistant_message_is_accepted(sdk):
    first = await sdk.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS,
                                              tool_choice=NAMED, max_tokens=200, temperature=0)
    message = first.choices[0].message
    (call,) = message.tool_calls
    echoed = message.model_dump()  # refusal, audio, function_call, annotations: all None
    assert {"refusal", "audio", "function_call", "annotations"} <= set(echoed)
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}
    conversation = [*ASK_WEATHER, echoed, result]
    second = await sdk.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS, max_tokens=16,
                                               temperature=0)
    assert second.choices[0].message.content or second.choices[0].message.tool_calls
    plain = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                              max_tokens=8, temperature=0)
    again = [{"role": "user", "content": "Hi!"}, plain.choices[0].message.model_dump(),
             {"role": "user", "content": "And again?"}]
    assert (await sdk.chat.completions.create(model=MODEL, messages=again, max_tokens=8)).choices
    with pytest.raises(openai.BadRequestError) as bad:
        refused = {"role": "assistant", "content": "No.", "refusal": "I won't"}
        await sdk.chat.completions.create(model=MODEL, max_tokens=8,
                                          messages=[{"role": "user", "content": "Hi!"}, refused])
    assert bad.value.body["param"] == "messages[1].refusal"


async def test_json_object_answers_are_compact(sdk):
    reply = await sdk.chat.completions.create(
        model=MODEL, max_tokens=64, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat in JSON, with its name, age and colour."}])
    text = reply.choices[0].message.content
    assert text.startswith("{") and "\n" not in text and "  " not in text


async def test_choice_i_of_seed_s_is_not_choice_0_of_seed_s_plus_i(sdk):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=16,
                  temperature=1.0)
    three = await sdk.chat.completions.create(seed=100, n=3, **kwargs)
    again = await sdk.chat.completions.create(seed=100, n=3, **kwargs)
    texts = [c.message.content for c in sorted(three.choices, key=lambda c: c.index)]
    assert texts == [c.message.content for c in sorted(again.choices, key=lambda c: c.index)]  # repeatable
    assert len(set(texts)) == 3
    for i in (1, 2):
        shifted = await sdk.chat.completions.create(seed=100 + i, **kwargs)
        assert shifted.choices[0].message.content != texts[i]
