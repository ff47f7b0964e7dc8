"""The clients that speak the Responses API, against a real gateway, a real Redis and a real
SmolLM2 scheduler (CPU, greedy): the `openai` SDK (plain and streamed, each the same text the
chat path gives the same conversation; a function tool across two turns), the OpenAI Agents
SDK's default model with a function tool, and langchain's ChatOpenAI(use_responses_api=True)."""

from __future__ import annotations

import json

import openai
import pytest
import pytest_asyncio
from agents import (
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_api,
    set_default_openai_client,
    set_tracing_disabled,
)
from langchain_openai import ChatOpenAI

from tests.gateway.conftest import MODEL

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
QUESTION = "What is the weather like in Paris right now?"


@pytest_asyncio.fixture
async def gateway(real_client):
    return await real_client()


@pytest_asyncio.fixture
async def sdk(gateway):
    sdk = openai.AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key="unused", max_retries=0)
    yield sdk
    await sdk.close()


async def chat_text(sdk, messages: list[dict], max_tokens: int, **extra) -> str:
    reply = await sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                              temperature=0, **extra)
    return reply.choices[0].message.content


async def test_plain_and_streamed_responses_are_the_chat_paths_greedy_text(sdk):
    expected = await chat_text(sdk, [{"role": "system", "content": "Answer in one sentence."},
                                     {"role": "user", "content": "What is the capital of France?"}], 24)
    plain = await sdk.responses.create(model=MODEL, instructions="Answer in one sentence.",
                                       input="What is the capital of France?", max_output_tokens=24,
                                       temperature=0)
    assert plain.output_text == expected
    stream = await sdk.responses.create(model=MODEL, instructions="Answer in one sentence.",
                                        input="What is the capital of France?", max_output_tokens=24,
                                        temperature=0, stream=True)
    events = [event async for event in stream]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    assert events[-1].response.output_text == expected
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_background_then_retrieve_and_chained_turns(sdk):
    import asyncio

    first = await sdk.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=16,
                                       temperature=0, background=True)
    for _ in range(600):
        first = await sdk.responses.retrieve(first.id)
        if first.status not in ("queued", "in_progress"):
            break
        await asyncio.sleep(0.1)
    assert first.status in ("completed", "incomplete")
    assert first.output_text == await chat_text(sdk, [{"role": "user", "content": "My name is Ada."}], 16)
    second = await sdk.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                        max_output_tokens=16, temperature=0)
    assert second.output_text == await chat_text(sdk, [
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}], 16)


async def test_text_format_json_schema_constrains_the_output(sdk):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    response = await sdk.responses.create(
        model=MODEL, input="Name the capital of France as JSON.", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "capital", "schema": schema, "strict": True}})
    assert response.status == "completed"
    assert set(json.loads(response.output_text)) == {"city"}
    assert response.text.format.type == "json_schema"


async def test_a_function_tool_across_two_turns(sdk):
    first = await sdk.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER], tool_choice="required",
                                       max_output_tokens=64, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    arguments = json.loads(call.arguments)
    assert isinstance(arguments["city"], str)
    # The same through the chat path: the same call, as generated.
    chat = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                             tools=[CHAT_WEATHER], tool_choice="required", max_tokens=64,
                                             temperature=0)
    assert chat.choices[0].message.tool_calls[0].function.arguments == call.arguments
    # A streamed first turn gives the same call, its arguments in function_call_arguments events.
    stream = await sdk.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER], tool_choice="required",
                                        max_output_tokens=64, temperature=0, stream=True)
    events = [event async for event in stream]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") \
        == call.arguments
    # Turn two: the tool's output, chained by previous_response_id.
    second = await sdk.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                        max_output_tokens=32, temperature=0, input=[
                                            {"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny, 24 C"}])
    assert second.status in ("completed", "incomplete")
    expected = await chat_text(sdk, [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 24 C"}], 32, tools=[CHAT_WEATHER])
    assert second.output_text == expected


async def test_the_agents_sdks_default_model_calls_a_function_tool(gateway):
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    client = openai.AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key="unused", max_retries=0)
    set_tracing_disabled(True)
    set_default_openai_client(client, use_for_tracing=False)
    set_default_openai_api("responses")  # (the default: said here so that the test means it)
    try:
        agent = Agent(name="weather", instructions="Use the tools to answer.", model=MODEL,
                      tools=[get_weather],
                      model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                   temperature=0, max_tokens=400),
                      tool_use_behavior="stop_on_first_tool")
        result = await Runner.run(agent, QUESTION)
        assert calls and result.final_output == f"Sunny in {calls[0]}"
        # The same run streamed.
        streamed = Runner.run_streamed(agent, QUESTION)
        async for _ in streamed.stream_events():
            pass
        assert streamed.final_output == result.final_output
        # The usual loop: the tool's result goes back to the model (the SDK sends the whole
        # history, our output items among it), which then answers in text.
        answering = agent.clone(tool_use_behavior="run_llm_again")
        answer = await Runner.run(answering, QUESTION, max_turns=4)
        kinds = [type(item).__name__ for item in answer.new_items]
        assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
        assert isinstance(answer.final_output, str) and answer.final_output
    finally:
        await client.close()


async def test_langchain_chat_openai_with_the_responses_api(gateway, sdk):
    expected = await chat_text(sdk, [{"role": "user", "content": "What is the capital of France?"}], 16)
    llm = ChatOpenAI(model=MODEL, base_url=str(gateway.make_url("/v1")), api_key="unused", temperature=0,
                     max_tokens=16, use_responses_api=True, max_retries=0)
    message = await llm.ainvoke("What is the capital of France?")
    assert message.text == expected
    chunks = [chunk async for chunk in llm.astream("What is the capital of France?")]
    assert "".join(chunk.text for chunk in chunks) == expected
    tooled = ChatOpenAI(model=MODEL, base_url=str(gateway.make_url("/v1")), api_key="unused", temperature=0,
                        max_tokens=400, use_responses_api=True, max_retries=0).bind_tools(
        [WEATHER], tool_choice="required", parallel_tool_calls=False)
    reply = await tooled.ainvoke(QUESTION)
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
