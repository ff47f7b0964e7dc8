"""Submit-and-poll against the fake scheduler: 202 + Location, polling, Idempotency-Key,
DELETE, deadlines, and the event stream resumed after every possible Last-Event-ID."""

from __future__ import annotations

import asyncio
import time

import pytest

from protocol.keys import Keys
from tests.gateway.conftest import MODEL
from tests.gateway.fake_scheduler import FakeScheduler

pytestmark = pytest.mark.asyncio

SUBMIT = {"kind": "completion", "model": MODEL, "prompt": "Once upon a time", "max_tokens": 12}


async def _poll_until_done(client, location: str, timeout_s: float = 20) -> dict:
    for _ in range(int(timeout_s / 0.05)):
        view = await (await client.get(location)).json()
        if view["status"] not in ("queued", "running"):
            return view
        await asyncio.sleep(0.05)
    raise TimeoutError(view)


def parse_sse(text: str) -> list[dict]:
    """Events as {"id", "event", "data"} (comments dropped)."""
    events = []
    for block in text.strip().split("\n\n"):
        event: dict = {}
        for line in block.splitlines():
            if line.startswith(":"):
                continue
            name, _, value = line.partition(": ")
            event[name] = value
        if event:
            events.append(event)
    return events


async def test_submit_then_poll_until_completed(make_client, fake_scheduler):
    client = await make_client()
    response = await client.post("/v1/requests", json=SUBMIT)
    assert response.status == 202
    submitted = await response.json()
    assert submitted["status"] == "queued" and submitted["kind"] == "completion"
    assert response.headers["Location"] == f"/v1/requests/{submitted['id']}"
    view = await _poll_until_done(client, response.headers["Location"])
    assert view["status"] == "completed"
    assert view["output"]["num_tokens"] == 12
    assert view["output"]["text"].startswith("The quick brown fox")
    assert view["usage"] == {"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16}
    timings = view["timings"]
    order = [timings[name] for name in ("queued_at", "started_at", "first_token_at", "finished_at")]
    assert order == sorted(order)
    assert view["result"]["object"] == "text_completion"
    assert view["result"]["choices"][0]["text"] == view["output"]["text"]
    assert view["last_event_id"] == 12


async def test_a_fresh_request_polls_as_queued_before_any_scheduler_takes_it(make_client, redis_server,
                                                                             tokenizer):
    with FakeScheduler(redis_server.url, MODEL, tokenizer, consume=False):
        client = await make_client()
        submitted = await (await client.post("/v1/requests", json=SUBMIT)).json()
        view = await (await client.get(f"/v1/requests/{submitted['id']}")).json()
    assert view["status"] == "queued"
    assert view["output"] == {"text": "", "num_tokens": 0, "finish_reason": None}


async def test_idempotency_key_returns_the_same_request(make_client, fake_scheduler, redis_server):
    client = await make_client()
    headers = {"Idempotency-Key": "order-42"}
    first = await client.post("/v1/requests", json=SUBMIT, headers=headers)
    again = await client.post("/v1/requests", json=SUBMIT, headers=headers)
    assert first.status == again.status == 202
    first_id = (await first.json())["id"]
    assert (await again.json())["id"] == first_id
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["Location"] == first.headers["Location"]
    # Queued once: one entry in the stream (the scheduler reads but never deletes them), and the
    # request the scheduler takes is the first.
    assert redis_server.client().xlen(Keys().request_stream(MODEL, "interactive")) == 1
    deadline = time.monotonic() + 30
    while not fake_scheduler.seen and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert [m.req_id for m in fake_scheduler.seen] == [first_id]
    other = await client.post("/v1/requests", json={**SUBMIT, "max_tokens": 3}, headers=headers)
    assert other.status == 409
    assert (await other.json())["error"]["param"] == "Idempotency-Key"
    fresh = await client.post("/v1/requests", json=SUBMIT, headers={"Idempotency-Key": "order-43"})
    assert (await fresh.json())["id"] != first_id


async def test_delete_cancels_a_queued_request_and_takes_it_off_the_queue(make_client, redis_server,
                                                                         tokenizer):
    with FakeScheduler(redis_server.url, MODEL, tokenizer, consume=False):
        client = await make_client()
        submitted = await (await client.post("/v1/requests", json=SUBMIT)).json()
        stream = Keys().request_stream(MODEL, "interactive")
        assert redis_server.client().xlen(stream) == 1
        response = await client.delete(f"/v1/requests/{submitted['id']}")
        assert response.status == 200
        view = await response.json()
        assert view["status"] == "cancelled"
        assert view["error"]["code"] == "cancelled"
        assert redis_server.client().xlen(stream) == 0
        events = parse_sse(await (await client.get(f"/v1/requests/{submitted['id']}/events")).text())
        assert events[0]["event"] == "error" and events[-1]["event"] == "done"


async def test_delete_cancels_a_running_request_end_to_end(make_client, redis_server, tokenizer):
    with FakeScheduler(redis_server.url, MODEL, tokenizer, token_delay_s=0.05) as fake:
        client = await make_client()
        submitted = await (await client.post("/v1/requests", json={**SUBMIT, "max_tokens": 200})).json()
        location = f"/v1/requests/{submitted['id']}"
        while (await (await client.get(location)).json())["output"]["num_tokens"] < 2:
            await asyncio.sleep(0.02)
        view = await (await client.delete(location)).json()
        assert view["status"] == "cancelled"
        assert view["output"]["finish_reason"] == "abort"
        assert view["output"]["num_tokens"] < 200
        assert fake.cancelled == [submitted["id"]]
        again = await client.delete(location)  # cancelling an ended request is a no-op
        assert (await again.json())["status"] == "cancelled"


async def test_unknown_or_malformed_ids_are_404(make_client, fake_scheduler):
    client = await make_client()
    for req_id in ("0" * 32, "not-an-id", "tf:res:x"):
        for method in ("GET", "DELETE"):
            response = await client.request(method, f"/v1/requests/{req_id}")
            assert response.status == 404
            assert (await response.json())["error"]["code"] == "request_not_found"
        assert (await client.get(f"/v1/requests/{req_id}/events")).status == 404


async def test_a_deadline_passed_in_the_queue_expires_the_request(make_client, redis_server, tokenizer):
    with FakeScheduler(redis_server.url, MODEL, tokenizer, consume=False):
        client = await make_client()
        submitted = await (await client.post("/v1/requests", json={**SUBMIT, "timeout": 0.2})).json()
        assert submitted["deadline"] is not None
        await asyncio.sleep(0.3)
        view = await (await client.get(f"/v1/requests/{submitted['id']}")).json()
    assert view["status"] == "expired"
    assert view["error"]["code"] == "expired"


async def _events(client, req_id: str, last_event_id: int | None) -> list[dict]:
    headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
    response = await client.get(f"/v1/requests/{req_id}/events", headers=headers)
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    return parse_sse(await response.text())


@pytest.mark.parametrize("write_offsets", [True, False], ids=["offsets", "no-offsets-fallback"])
async def test_events_resume_after_any_last_event_id_with_nothing_repeated_or_missing(
        make_client, redis_server, tokenizer, write_offsets):
    import json

    with FakeScheduler(redis_server.url, MODEL, tokenizer, write_offsets=write_offsets, token_delay_s=0.01):
        client = await make_client()
        submitted = await (await client.post("/v1/requests", json={**SUBMIT, "max_tokens": 16})).json()
        live = await _events(client, submitted["id"], None)  # attached from the start, live
        final = await _poll_until_done(client, f"/v1/requests/{submitted['id']}")
        assert [e["event"] for e in live[-1:]] == ["done"]
        tokens = [json.loads(e["data"]) for e in live[:-1]]
        assert [int(e["id"]) for e in live[:-1]] == [t["seq"] for t in tokens]
        assert "".join(t["text"] for t in tokens) == final["output"]["text"]
        for after in range(0, 17):
            events = await _events(client, submitted["id"], after)
            data = [json.loads(e["data"]) for e in events if e["event"] != "done"]
            head = "".join(t["text"] for t in tokens if t["seq"] <= after)
            tail = "".join(d["text"] for d in data)
            assert head + tail == final["output"]["text"], after
            assert sum(len(d["token_ids"]) for d in data) == 16 - min(after, 16)
            if after < 16:
                assert data[-1]["seq"] == 16 and data[-1]["finish_reason"] == "length"
            else:
                assert data == []


async def test_events_attach_half_way_through_a_live_request(make_client, redis_server, tokenizer):
    import json

    with FakeScheduler(redis_server.url, MODEL, tokenizer, token_delay_s=0.03):
        client = await make_client()
        submitted = await (await client.post("/v1/requests", json={**SUBMIT, "max_tokens": 30})).json()
        location = f"/v1/requests/{submitted['id']}"
        while (await (await client.get(location)).json())["output"]["num_tokens"] < 5:
            await asyncio.sleep(0.01)
        response = await client.get(f"{location}/events", headers={"Last-Event-ID": "3"})
        seqs, text = [], ""
        for event in parse_sse(await response.text()):
            if event["event"] == "token":
                data = json.loads(event["data"])
                seqs.append(data["seq"])
                text += data["text"]
        final = await (await client.get(location)).json()
    assert seqs[0] >= 5 and seqs[-1] == 30  # one catch-up event, then live ones
    assert seqs == sorted(set(seqs))
    prefix = final["output"]["text"][: len(final["output"]["text"]) - len(text)]
    assert prefix + text == final["output"]["text"]
    assert len(tokenizer(prefix, add_special_tokens=False).input_ids) == 3


async def test_submit_chat_with_logprobs_reports_them_in_the_result(make_client, fake_scheduler):
    client = await make_client()
    body = {"kind": "chat", "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "logprobs": True, "top_logprobs": 2}
    submitted = await (await client.post("/v1/requests", json=body)).json()
    view = await _poll_until_done(client, f"/v1/requests/{submitted['id']}")
    content = view["result"]["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    assert all(len(item["top_logprobs"]) == 2 for item in content)


async def test_an_idempotent_retry_is_answered_even_when_the_queue_is_full(make_client, redis_server,
                                                                           tokenizer):
    with FakeScheduler(redis_server.url, MODEL, tokenizer, consume=False):
        client = await make_client(max_queue=1)
        headers = {"Idempotency-Key": "only-once"}
        first = await (await client.post("/v1/requests", json=SUBMIT, headers=headers)).json()
        retry = await client.post("/v1/requests", json=SUBMIT, headers=headers)
        assert retry.status == 202 and (await retry.json())["id"] == first["id"]
        assert (await client.post("/v1/requests", json=SUBMIT)).status == 429


async def test_a_retry_after_a_submit_redis_half_took_finds_a_request_that_exists(make_client, redis_server,
                                                                                   fake_scheduler):
    """Redis takes the submit's first write and then no more (as when Redis, or the gateway
    worker, dies between two of its commands): the client's retry with the same
    Idempotency-Key must answer a request that exists, never an id that was never queued."""
    client = await make_client()
    admin = redis_server.client()
    headers = {"Idempotency-Key": "half-taken"}
    admin.execute_command("ACL", "SETUSER", "default", "-@scripting")  # plain commands pass, scripts fail
    try:
        failed = await client.post("/v1/requests", json=SUBMIT, headers=headers)
    finally:
        admin.execute_command("ACL", "SETUSER", "default", "+@all")
    assert failed.status >= 500
    retry = await client.post("/v1/requests", json=SUBMIT, headers=headers)
    assert retry.status == 202
    polled = await client.get(retry.headers["Location"])
    assert polled.status == 200, await polled.text()
    view = await _poll_until_done(client, retry.headers["Location"])
    assert view["status"] == "completed"


async def test_created_is_integer_seconds_fixed_at_submit_in_every_answer(make_client, redis_server,
                                                                          tokenizer):
    """The 202, an Idempotency-Key replay, every poll and the finished result say the same
    `created`: integer seconds, as OpenAI's objects, taken once when the request was submitted."""
    headers = {"Idempotency-Key": "created-once"}
    with FakeScheduler(redis_server.url, MODEL, tokenizer, consume=False):  # queued while we look
        client = await make_client()
        first = await (await client.post("/v1/requests", json=SUBMIT, headers=headers)).json()
        await asyncio.sleep(0.01)
        replay = await (await client.post("/v1/requests", json=SUBMIT, headers=headers)).json()
        polled = await (await client.get(f"/v1/requests/{first['id']}")).json()
    assert type(first["created"]) is int
    assert first["created"] == replay["created"] == polled["created"]
    queued_at = float(redis_server.client().hget(Keys().result(first["id"]), "queued_at"))
    assert first["created"] == int(queued_at)
    with FakeScheduler(redis_server.url, MODEL, tokenizer):
        done = await _poll_until_done(client, f"/v1/requests/{first['id']}")
    assert done["status"] == "completed"
    assert done["created"] == done["result"]["created"] == first["created"]
