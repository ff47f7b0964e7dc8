"""The gateway in front of a REAL scheduler (SchedulerService + LLMEngine on SmolLM2, CPU,
float32) and a real Redis; the official `openai` package as the client where it applies.
One scheduler serves the whole module."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest
import pytest_asyncio

from protocol.keys import Keys
from tests.gateway.conftest import MODEL
from tests.gateway.test_requests_api import parse_sse

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest_asyncio.fixture
async def sdk(real_client):
    client = await real_client()
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    sdk.http = client
    yield sdk
    await sdk.close()


async def test_chat_answers_paris_and_the_stream_concatenates_to_the_same_text(sdk):
    plain = await sdk.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=32, temperature=0)
    answer = plain.choices[0].message.content
    assert "Paris" in answer
    assert plain.choices[0].finish_reason == "stop"
    assert plain.usage.completion_tokens > 0 and plain.usage.prompt_tokens > 10
    stream = await sdk.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=32, temperature=0,
                                               stream=True, stream_options={"include_usage": True})
    deltas, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            deltas.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(deltas) == answer
    assert finish == "stop"
    # The same prompt again: its full KV blocks came from the prefix cache, and usage says so.
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    assert usage.completion_tokens == plain.usage.completion_tokens
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached == (plain.usage.prompt_tokens - 1) // 16 * 16 > 0
    # And over plain HTTP: the stream's last line is data: [DONE].
    body = {"model": MODEL, "messages": CAPITAL, "max_tokens": 32, "temperature": 0, "stream": True}
    raw = await sdk.http.post("/v1/chat/completions", json=body)
    assert (await raw.text()).rstrip().endswith("data: [DONE]")


async def test_completions_stop_strings_and_logprobs(sdk):
    prompt = "The days of the week are Monday, Tuesday,"
    base = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                        logprobs=2, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    assert base.choices[0].finish_reason == "length" and base.usage.completion_tokens == 24
    logprobs = base.choices[0].logprobs
    assert len(logprobs.tokens) == 24 and "".join(logprobs.tokens) == text
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(len(top) <= 2 and logprobs.tokens[i] in top for i, top in enumerate(logprobs.top_logprobs))
    word = text.split()[3]  # a stop string somewhere in the middle
    stopped = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                           stop=[word, "never-there"])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(word)]
    streamed = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                            stop=word, stream=True)
    assert "".join([c.choices[0].text async for c in streamed]) == stopped.choices[0].text


async def test_seeded_sampling_repeats_and_n2_gives_two_choices(sdk):
    args = dict(model=MODEL, messages=POEM, max_tokens=16, temperature=1.0, seed=1234,
                extra_body={"ignore_eos": True})
    first = await sdk.chat.completions.create(**args)
    again = await sdk.chat.completions.create(**args)
    assert first.choices[0].message.content == again.choices[0].message.content
    both = await sdk.chat.completions.create(n=2, **args)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].message.content == first.choices[0].message.content  # choice 0 keeps the seed
    assert both.choices[1].message.content != first.choices[0].message.content  # choice 1: seed + 1
    assert both.usage.completion_tokens == 32


async def test_chat_logprobs_match_greedy_choices(sdk):
    response = await sdk.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    ended_on_eos = response.choices[0].finish_reason == "stop"  # the end token is not listed
    assert len(content) == response.usage.completion_tokens - ended_on_eos
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token  # greedy: the chosen token is the likeliest
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-4)
        assert bytes(item.bytes).decode() == item.token


async def test_logprobs_leave_out_the_end_token_so_their_bytes_rebuild_the_content(sdk):
    # The greedy answer ends with <|im_end|> (finish_reason stop) well within 48 tokens; OpenAI lists
    # no entry for the end token, on chat and completions, streamed and not.
    chat = await sdk.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=48, temperature=0,
                                             logprobs=True)
    assert chat.choices[0].finish_reason == "stop"
    content = chat.choices[0].logprobs.content
    assert b"".join(bytes(item.bytes) for item in content).decode() == chat.choices[0].message.content
    assert len(content) == chat.usage.completion_tokens - 1  # the end token is counted, not listed
    stream = await sdk.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=48, temperature=0,
                                               logprobs=True, stream=True)
    streamed = [item async for chunk in stream for choice in chunk.choices
                if choice.logprobs is not None for item in choice.logprobs.content or []]
    assert [item.token for item in streamed] == [item.token for item in content]
    prompt, period = "The capital of France is", {"stop_token_ids": [30]}  # "." (id 30) as a stop token
    text = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, logprobs=1,
                                        extra_body=period)
    choice = text.choices[0]
    assert choice.finish_reason == "stop"
    assert "".join(choice.logprobs.tokens) == choice.text
    stream = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0,
                                          logprobs=1, extra_body=period, stream=True)
    tokens = [t async for chunk in stream for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    assert "".join(tokens) == choice.text


async def test_submit_poll_and_reattach_half_way_equals_the_non_streamed_result(real_client):
    client = await real_client()
    body = {"model": MODEL, "messages": POEM, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    expected = (await (await client.post("/v1/chat/completions", json=body)).json())["choices"][0]
    submitted = await client.post("/v1/requests", json={**body, "kind": "chat"},
                                  headers={"Idempotency-Key": "poem-1"})
    assert submitted.status == 202
    location = submitted.headers["Location"]
    # Attach, take ten events, walk away.
    first_half, last_id = "", 0
    async with aiohttp.ClientSession() as session:
        async with session.get(client.make_url(f"{location}/events")) as response:
            block = ""
            async for line in response.content:
                block += line.decode()
                if block.endswith("\n\n"):
                    (event,) = parse_sse(block)
                    block = ""
                    data = json.loads(event["data"])
                    first_half += data["text"]
                    last_id = int(event["id"])
                    if last_id >= 10:
                        break
    retry = await client.post("/v1/requests", json={**body, "kind": "chat"},
                              headers={"Idempotency-Key": "poem-1"})
    assert retry.headers["Location"] == location  # the walk-away did not cancel it, the retry re-finds it
    # Re-attach after the last event seen: the rest, nothing repeated, nothing missing.
    resumed = await client.get(f"{location}/events", headers={"Last-Event-ID": str(last_id)})
    rest = parse_sse(await resumed.text())
    tokens = [json.loads(e["data"]) for e in rest if e["event"] == "token"]
    assert int(rest[0]["id"]) > last_id
    assert first_half + "".join(t["text"] for t in tokens) == expected["message"]["content"]
    view = await (await client.get(location)).json()
    assert view["status"] == "completed"
    assert view["output"]["text"] == expected["message"]["content"]
    assert view["usage"]["completion_tokens"] == 40
    # The chat call before it computed the same prompt: the submitted one reused its blocks.
    cached = view["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and view["result"]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert view["timings"]["queue_s"] is not None and view["timings"]["time_to_first_token_s"] > 0


async def test_a_streaming_client_that_leaves_frees_its_request_within_one_step(real_client, real_scheduler,
                                                                               module_redis):
    client = await real_client()
    engine = real_scheduler.engine
    redis = module_redis.client()
    body = {"model": MODEL, "messages": POEM, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with aiohttp.ClientSession() as session:
        response = await session.post(client.make_url("/v1/chat/completions"), json=body)
        chunks = 0
        async for line in response.content:
            if line.startswith(b"data: {"):
                req_id = json.loads(line[6:])["id"].removeprefix("chatcmpl-")
                chunks += 1
                if chunks == 4:
                    break
        response.close()  # the client goes away mid-stream
    keys = Keys()
    deadline = time.monotonic() + 10
    while not redis.exists(keys.cancelled(req_id)):
        assert time.monotonic() < deadline, "the gateway did not cancel"
        await asyncio.sleep(0.001)
    steps_at_cancel = engine.num_steps
    while redis.hget(keys.result(req_id), "state") != b"cancelled":
        assert time.monotonic() < deadline, "the scheduler did not stop the request"
        await asyncio.sleep(0.005)
    assert engine.num_steps - steps_at_cancel <= 1  # stopped within one step
    assert engine.scheduler.get_request(req_id) is None  # freed: nothing of it is left in the scheduler
    usage = json.loads(redis.hget(keys.result(req_id), "usage"))
    assert usage["completion_tokens"] < 300


async def test_a_tenants_request_runs_from_its_own_stream_and_its_lease_ends_with_it(real_client,
                                                                                     module_redis):
    from gateway.tenants import TenantDirectory

    directory = TenantDirectory.from_map({"tenants": {"team-a": {"keys": ["key-a"],
                                                                  "max_concurrent_requests": 4}}})
    client = await real_client(tenants=directory)
    headers = {"Authorization": "Bearer key-a"}
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    response = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status == 200
    assert "Paris" in (await response.json())["choices"][0]["message"]["content"]
    submitted = await client.post("/v1/requests", json={**body, "kind": "chat"}, headers=headers)
    req_id = (await submitted.json())["id"]
    for _ in range(600):  # nobody waits for this one: the scheduler's terminal write ends its lease
        record = await (await client.get(f"/v1/requests/{req_id}", headers=headers)).json()
        if record["status"] == "completed":
            break
        await asyncio.sleep(0.1)
    assert record["status"] == "completed"
    keys = Keys()
    plain = module_redis.client()
    assert plain.zcard(keys.tenant_leases("team-a")) == 0
    assert plain.sismember(keys.tenants(MODEL), "team-a")
    assert plain.xlen(keys.request_stream(MODEL, "interactive", "team-a")) == 0  # served and acknowledged
