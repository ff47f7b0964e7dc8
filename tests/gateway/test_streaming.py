"""Streams and waits against the fake scheduler: one pub/sub connection for all of them,
records that fill lost events, and clients that leave cancel their requests."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from gateway.serving.pubsub import ROUTER
from protocol.keys import Keys
from testkit.sse import DONE, data_fields
from tests.gateway.conftest import MODEL
from tests.gateway.fake_scheduler import FakeScheduler

pytestmark = pytest.mark.asyncio

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def chunks_of(text: str) -> list:
    """The data of each event (an event may start with its `id:` line)."""
    lines = data_fields(text)
    assert lines[-1] == DONE
    return [json.loads(line) for line in lines[:-1]]


async def test_many_concurrent_streams_share_one_pubsub_connection(make_client, fake_scheduler, redis_server):
    client = await make_client()

    async def one() -> str:
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks_of(await response.text()))

    texts = await asyncio.gather(*(one() for _ in range(20)))
    assert len(set(texts)) == 1 and texts[0].startswith("The quick")
    clients = redis_server.client().client_list()
    subscribers = [c for c in clients if int(c.get("sub", 0)) + int(c.get("psub", 0)) > 0]
    assert len(subscribers) == 1  # this gateway's one pub/sub connection
    deadline = time.monotonic() + 30  # every channel unsubscribed (in the background)
    while client.gateway_app[ROUTER].num_channels != 0:
        assert time.monotonic() < deadline, client.gateway_app[ROUTER].num_channels
        await asyncio.sleep(0.02)


async def test_stream_and_non_stream_agree_and_end_with_usage_and_done(make_client, fake_scheduler):
    client = await make_client()
    plain = await (await client.post("/v1/chat/completions", json={**CHAT, "n": 2})).json()
    streamed = chunks_of(await (await client.post("/v1/chat/completions", json={
        **CHAT, "n": 2, "stream": True, "stream_options": {"include_usage": True}})).text())
    texts = {0: "", 1: ""}
    for chunk in streamed[:-1]:
        assert chunk["usage"] is None
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in plain["choices"]]
    assert streamed[-1]["choices"] == [] and streamed[-1]["usage"] == plain["usage"]
    assert plain["usage"]["completion_tokens"] == 16  # 2 choices x 8; the prompt counted once
    finishes = [c["choices"][0]["finish_reason"] for c in streamed[:-1] if c["choices"][0]["finish_reason"]]
    assert finishes == ["length", "length"]


async def test_completions_echo_and_several_prompts(make_client, fake_scheduler):
    client = await make_client()
    body = {"model": MODEL, "prompt": ["Hello", "Goodbye"], "max_tokens": 3, "n": 2, "echo": True}
    response = await (await client.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in response["choices"]] == [0, 1, 2, 3]
    assert [c["text"].split(" ")[0] for c in response["choices"]] == ["HelloThe", "HelloThe", "GoodbyeThe",
                                                                     "GoodbyeThe"]
    seeds = [m.sampling_params().seed for m in fake_scheduler.seen]
    assert seeds == [None] * 4


async def test_seeds_are_derived_per_choice(make_client, fake_scheduler):
    client = await make_client()

    async def seeds(seed: int, n: int) -> list[int]:
        fake_scheduler.seen.clear()
        await client.post("/v1/chat/completions", json={**CHAT, "n": n, "seed": seed})
        return sorted(m.sampling_params().seed for m in fake_scheduler.seen)

    first = await seeds(41, 3)
    assert 41 in first and len(set(first)) == 3
    assert await seeds(41, 3) == first  # repeatable
    # Choice i of seed s is not choice 0 of seed s + i: nearby seeds share no choice seed.
    assert not set(first) & set(await seeds(42, 3))
    assert all(-(2**63) <= seed < 2**63 for seed in first)


async def test_a_constrained_answer_without_max_tokens_is_bounded_by_the_documented_default(make_client,
                                                                                          fake_scheduler):
    from gateway.api.openai.params import DEFAULT_CONSTRAINED_MAX_TOKENS

    client = await make_client()
    free = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra in ({"response_format": {"type": "json_object"}}, {"tools": tools, "tool_choice": "required"},
                  {}, {"response_format": {"type": "json_object"}, "max_tokens": 2000}):
        fake_scheduler.seen.clear()
        assert (await client.post("/v1/chat/completions", json={**free, **extra})).status == 200
        max_tokens = fake_scheduler.seen[0].sampling_params().max_tokens
        if "max_tokens" in extra:
            assert max_tokens == extra["max_tokens"]
        elif extra:
            assert max_tokens == DEFAULT_CONSTRAINED_MAX_TOKENS
        else:
            assert max_tokens > DEFAULT_CONSTRAINED_MAX_TOKENS  # the rest of the context window


async def test_with_tools_a_stream_opens_with_content_null(make_client, fake_scheduler):
    client = await make_client()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_tools = chunks_of(await (await client.post("/v1/chat/completions",
                                                    json={**CHAT, "stream": True, "tools": tools})).text())
    assert with_tools[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in with_tools if c["choices"])
    assert text  # the fake's reply is text: it still arrives as content
    plain = chunks_of(await (await client.post("/v1/chat/completions", json={**CHAT, "stream": True})).text())
    assert plain[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


async def test_every_parameter_reaches_the_scheduler(make_client, fake_scheduler):
    client = await make_client()
    body = {**CHAT, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 3, "stop": "END",
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "ignore_eos": True,
            "stop_token_ids": [7], "priority": -2, "logprobs": True, "top_logprobs": 4,
            "max_completion_tokens": 8, "user": "u1", "response_format": {"type": "text"}, "tools": []}
    assert (await client.post("/v1/chat/completions", json=body)).status == 200
    (message,) = fake_scheduler.seen
    sp = message.sampling_params()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.seed, sp.stop) == (0.7, 0.9, 5, 0.05, 3, ["END"])
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (sp.ignore_eos, sp.stop_token_ids, sp.logprobs, sp.max_tokens) == (True, [7], 4, 8)
    assert message.priority == -2


async def test_chat_default_max_tokens_is_the_rest_of_the_context(make_client, fake_scheduler, tokenizer):
    client = await make_client()
    body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    response = await client.post("/v1/chat/completions", json={**body, "stream": True})
    await response.text()  # to the end: the headers alone come before the scheduler took the entry
    (message,) = fake_scheduler.seen
    assert message.sampling_params().max_tokens == 8192 - len(message.prompt_token_ids)


async def test_lost_events_are_filled_from_the_record(make_client, redis_server, tokenizer, monkeypatch):
    """Pub/sub is never the only copy: a scheduler whose events all vanish still completes."""
    from service import result_store

    real_write = result_store.ResultStore.write

    def write_without_events(self, updates):
        for update in updates:
            update.event = None
        return real_write(self, updates)

    monkeypatch.setattr(result_store.ResultStore, "write", write_without_events)
    with FakeScheduler(redis_server.url, MODEL, tokenizer):
        client = await make_client(poll_s=0.1)
        plain = await (await client.post("/v1/chat/completions", json=CHAT)).json()
        streamed = chunks_of(await (await client.post("/v1/chat/completions",
                                                      json={**CHAT, "stream": True})).text())
    assert plain["choices"][0]["message"]["content"].startswith("The quick")
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in streamed)
    assert text == plain["choices"][0]["message"]["content"]


async def _wait_cancelled(fake: FakeScheduler, redis_server, timeout_s: float = 10) -> str:
    for _ in range(int(timeout_s / 0.02)):
        if fake.cancelled:
            return fake.cancelled[0]
        await asyncio.sleep(0.02)
    raise TimeoutError("the request was not cancelled")


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "waiting"])
async def test_a_client_that_disconnects_cancels_its_request(make_client, redis_server, tokenizer, stream):
    with FakeScheduler(redis_server.url, MODEL, tokenizer, token_delay_s=0.05) as fake:
        client = await make_client()
        url = client.make_url("/v1/chat/completions")
        async with aiohttp.ClientSession() as session:
            if stream:
                response = await session.post(url, json={**CHAT, "max_tokens": 500, "stream": True})
                for _ in range(3):
                    await response.content.readline()
                response.close()  # drops the connection
            else:
                task = asyncio.ensure_future(session.post(url, json={**CHAT, "max_tokens": 500}))
                while not fake.seen:
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.2)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        req_id = await _wait_cancelled(fake, redis_server)
    record = redis_server.client().hgetall(Keys().result(req_id))
    assert record[b"state"] == b"cancelled"
    assert redis_server.client().exists(Keys().cancelled(req_id))
    assert len(json.loads(record[b"usage"])) == 3 and json.loads(record[b"usage"])["completion_tokens"] < 500


async def test_a_quiet_stream_gets_keepalives_and_still_ends_complete(make_client, redis_server, tokenizer):
    """Between slow tokens the follower's quiet-spell timer fires (poll_s), the record is looked
    at, and the client gets `: keep-alive` lines once keepalive_s has passed without a write."""
    with FakeScheduler(redis_server.url, MODEL, tokenizer, token_delay_s=0.35):
        client = await make_client(poll_s=0.1, keepalive_s=0.2)
        response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "stream": True})
        raw = await response.read()
    text = raw.decode()
    assert ": keep-alive\n" in text.split("id: 1\n", 1)[1]  # (a keep-alive after an event with an id)
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks_of(text))
    assert content == tokenizer.decode(tokenizer("The quick brown", add_special_tokens=False).input_ids[:3])
    # The official SDK's decoder sees only the chunks (a keep-alive after an `id:` line made it
    # dispatch an empty event, which its stream then failed to parse: JSONDecodeError).
    from openai._streaming import SSEDecoder

    events = list(SSEDecoder().iter_bytes(iter([raw])))
    assert events and all(e.data for e in events), [e for e in events if not e.data]
    assert [json.loads(e.data) for e in events[:-1]] and events[-1].data == "[DONE]"


async def test_a_chat_stream_carries_event_ids_and_its_request_id_to_resume_from(make_client, fake_scheduler):
    from tests.gateway.test_requests_api import parse_sse

    client = await make_client()
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 8})
    (req_id,) = response.headers["tokenfleet-request-id"].split(",")
    events = parse_sse(await response.text())
    assert json.loads(events[0]["data"])["id"] == "chatcmpl-" + req_id
    with_ids = [e for e in events if "id" in e]
    assert [int(e["id"]) for e in with_ids] == list(range(1, 9))  # one per token event, in order
    texts = [json.loads(e["data"])["choices"][0]["delta"].get("content") or "" for e in with_ids]
    # Resuming after the third event gives exactly the rest, from the request's own event stream.
    resumed = parse_sse(await (await client.get(f"/v1/requests/{req_id}/events",
                                                headers={"Last-Event-ID": with_ids[2]["id"]})).text())
    rest = "".join(json.loads(e["data"])["text"] for e in resumed if e.get("event") == "token")
    assert rest == "".join(texts[3:])
    several = await client.post("/v1/chat/completions", json={**CHAT, "n": 2})
    assert len(several.headers["tokenfleet-request-id"].split(",")) == 2


async def test_an_event_stream_carries_the_request_id(make_client, fake_scheduler):
    client = await make_client()
    mine = await client.post("/v1/chat/completions", json={**CHAT, "stream": True},
                             headers={"X-Request-Id": "abc-123"})
    assert mine.headers["X-Request-Id"] == "abc-123"
    await mine.read()
    ours = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True})
    assert len(ours.headers["X-Request-Id"]) == 32
    await ours.read()


async def test_a_cancelled_choice_reports_an_openai_finish_reason(make_client, redis_server, tokenizer):
    """A choice cancelled mid-way (DELETE on its id) ends with "length" (cut short), never a value
    the SDK's types lack ("abort"), streamed or not; its own record says "cancelled"."""
    with FakeScheduler(redis_server.url, MODEL, tokenizer, token_delay_s=0.05):
        client = await make_client()
        response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 200, "stream": True})
        req_id = response.headers["tokenfleet-request-id"]
        await response.content.readline()
        assert (await (await client.delete(f"/v1/requests/{req_id}")).json())["status"] == "cancelled"
        chunks = [json.loads(c) for c in data_fields(await response.text()) if c != DONE]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert "abort" not in json.dumps(chunks)

        calling = asyncio.ensure_future(client.post("/v1/completions",
                                                    json={"model": MODEL, "prompt": "hi", "max_tokens": 200}))
        records = Keys().result("*")
        while not (found := list(redis_server.client().scan_iter(match=records))) or len(found) < 2:
            await asyncio.sleep(0.02)
        other = next(k.decode().rsplit(":", 1)[-1] for k in found if req_id not in k.decode())
        await client.delete(f"/v1/requests/{other}")
        answer = await (await calling).json()
        assert answer["choices"][0]["finish_reason"] == "length"
