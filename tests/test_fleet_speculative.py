"""Speculative decoding through the fleet, on SmolLM2's real weights: `tokenfleet up
--speculative-config` streams a chat that copies a passage, whose greedy text equals the
in-process engine's without speculation, and the scheduler's heartbeat counts accepted drafts;
streamed chats whose scheduler is killed (kill -9) mid-stream and resumed by the one `up` starts
again give that text too, their events of several tokens resumed exactly with Last-Event-ID."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import urllib.request
from dataclasses import dataclass, field

import aiohttp
import pytest
import redis

from protocol.result_record import ResultRecord
from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.net import free_port
from shared.sampling import SamplingParams
from testkit.spec_runs import COPY_PROMPTS, PASSAGES
from testkit.sse import DONE, data_fields
from tests.fleet_helpers import KEYS, UpProcess

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
SPEC = '{"method": "ngram", "num_speculative_tokens": 4}'


def test_a_streamed_chat_with_speculation_equals_plain_greedy(smollm2, tmp_path) -> None:
    with LLMEngine(EngineConfig(model=str(smollm2), dtype="float32", num_kv_blocks=64)) as engine:
        (plain,) = engine.generate([COPY_PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                   chat=True)
    port = free_port()
    home = tmp_path / "home"
    up = UpProcess(["--port", str(port), "--model", str(smollm2), "--num-kv-blocks", "64",
                    "--dtype", "float32", "--gateway-workers", "1", "--device", "cpu",
                    "--speculative-config", SPEC], home)
    try:
        up.wait_up()
        body = json.dumps({"model": smollm2.name, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                           "messages": [{"role": "user", "content": COPY_PROMPTS[0]}]})
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body.encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            events = data_fields(response.read().decode())
        assert events[-1] == DONE
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == plain.text
        client = redis.Redis.from_url(json.loads((home / "fleet.json").read_text())["redis_url"])
        key = KEYS.scheduler(f"{smollm2.name}-0")
        deadline = time.monotonic() + 30
        while int(client.hget(key, "spec_num_accepted_tokens") or 0) == 0:  # (the next heartbeat's)
            assert time.monotonic() < deadline, client.hgetall(key)
            time.sleep(0.2)
    finally:
        assert up.stop() == 0, up.output[-3000:]


# -- kill -9 of the scheduler mid-stream, with speculation on ------------------------------------

# Passages to copy: SmolLM2 quotes them back, so most drafts are accepted, and each request
# streams events of several tokens, before the kill and after its resume. Each greedy copy is 78
# tokens or more, so each request runs to max_tokens, some nine verify steps past the kill's
# condition. (Asked to "repeat" the third passage, the model gave a 33-token summary whose first
# look-ups found nothing: on a loaded machine it could end before the kill.)
RESUME_PROMPTS = [*COPY_PROMPTS, "Copy this text exactly:\n\n" + PASSAGES[0][PASSAGES[0].index("Nobody"):]]
RESUME_MAX_TOKENS = 64
NUM_TOKENS_AT_KILL = 12  # every request has made this many before the kill, and none has ended
# The expected-gain rule off (min_speedup and min_acceptance_rate 0: a request never backs off):
# it prices look-ups with the step cost model, whose times on a loaded machine could keep a
# request from drafting until it ended. Without it, which steps carry drafts follows from the
# tokens alone, in both schedulers.
RESUME_SPEC = ('{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":2,'
               '"min_speedup":0,"min_acceptance_rate":0}')


@dataclass
class EventsClient:
    """One request's GET /v1/requests/{id}/events, read live, left, and opened again with
    Last-Event-ID: the data of every event as it came."""

    req_id: str
    events: list[dict] = field(default_factory=list)
    # (index in events, Last-Event-ID) of each reconnect: where a catch-up may merge events
    resumes: list[tuple[int, int]] = field(default_factory=list)
    is_done: bool = False

    @property
    def last_seq(self) -> int:
        return self.events[-1]["seq"] if self.events else 0

    async def read(self, session: aiohttp.ClientSession, url: str, leave=lambda client: False) -> None:
        """Events until the stream's end, or until `leave(self)` holds after one."""
        if self.events:
            self.resumes.append((len(self.events), self.last_seq))
        async with session.get(f"{url}/v1/requests/{self.req_id}/events",
                               headers={"Last-Event-ID": str(self.last_seq)}) as response:
            assert response.status == 200, await response.text()
            event_id = None
            async for raw in response.content:
                line = raw.decode().rstrip("\n")
                if line.startswith("id: "):
                    event_id = int(line[4:])
                elif line == "event: done":
                    self.is_done = True
                    return
                elif line.startswith("data: ") and event_id is not None:
                    data = json.loads(line[6:])
                    assert data["seq"] == event_id, (data, event_id)
                    self.events.append(data)
                    if leave(self):
                        return


@dataclass
class KillRun:
    undisturbed: list[EventsClient]  # the same chats, run first on the same fleet
    clients: list[EventsClient]  # the chats whose scheduler was killed
    replays: list[EventsClient]  # each of those read again after the end, from its first multi-token event
    records: list[ResultRecord]
    resumed_from_seq: list[int]  # per request: the seq the restarted scheduler took it over at
    accepted_undisturbed: int  # the victim's accepted draft tokens once the undisturbed run ended
    accepted_after_kill: int  # the restarted scheduler's (a new process: counted from 0)
    metrics_accepted: float  # tokenfleet:spec_decode_num_accepted_tokens_total in /metrics, at the end


def _heartbeat(client: redis.Redis, scheduler_id: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(KEYS.scheduler(scheduler_id)).items()}


def _record(client: redis.Redis, req_id: str) -> tuple[ResultRecord, dict[bytes, bytes]]:
    raw = client.hgetall(KEYS.result(req_id))
    return ResultRecord.parse(req_id, raw), raw


def _accepted(beat: dict[str, str]) -> int:
    return int(beat.get("spec_num_accepted_tokens", 0))


def _has_multi_token_event(client: EventsClient) -> bool:
    return any(len(e["token_ids"]) > 1 for e in client.events)


def _has_multi_token_offsets(record: ResultRecord) -> bool:
    """Whether some event of the record carried several tokens (a step's accepted drafts)."""
    totals = [0, *(num_tokens for num_tokens, _ in record.offsets)]
    return any(b - a > 1 for a, b in zip(totals, totals[1:], strict=False))


async def _until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.05)


async def _submit_chats(session: aiohttp.ClientSession, url: str, model: str) -> list[EventsClient]:
    clients = []
    for prompt in RESUME_PROMPTS:
        body = {"kind": "chat", "model": model, "max_tokens": RESUME_MAX_TOKENS, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]}
        async with session.post(f"{url}/v1/requests", json=body) as response:
            assert response.status == 202, await response.text()
            clients.append(EventsClient((await response.json())["id"]))
    return clients


async def _run_undisturbed(session: aiohttp.ClientSession, url: str, model: str,
                           db: redis.Redis) -> tuple[list[EventsClient], int]:
    """The chats read to their end; the scheduler's accepted draft tokens once they ended (from
    the first heartbeat that counts them finished: nothing else runs)."""
    clients = await _submit_chats(session, url, model)
    await asyncio.gather(*(client.read(session, url) for client in clients))
    deadline = time.monotonic() + 15
    while int((beat := _heartbeat(db, f"{model}-0")).get("num_finished", 0)) < len(clients):
        assert time.monotonic() < deadline, f"no heartbeat counts the undisturbed run finished: {beat}"
        await asyncio.sleep(0.05)
    return clients, _accepted(beat)


async def _kill_mid_stream(url: str, model: str, db: redis.Redis) -> KillRun:
    """The chats run undisturbed, then again: the scheduler killed once each has made
    NUM_TOKENS_AT_KILL tokens and streamed an event of several tokens (accepted drafts; from the
    record, not the heartbeat: the requests may end within a heartbeat's second); one client stays attached
    throughout, one leaves at the kill and comes back at once, one leaves after its first event
    of several tokens and comes back once the restarted scheduler has written more."""
    scheduler_id = f"{model}-0"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        undisturbed, accepted_undisturbed = await _run_undisturbed(session, url, model, db)
        clients = await _submit_chats(session, url, model)
        stays, at_once, late = clients
        reads = [asyncio.create_task(stays.read(session, url)),
                 asyncio.create_task(at_once.read(session, url)),
                 asyncio.create_task(late.read(session, url, leave=_has_multi_token_event))]

        def ready_to_kill() -> bool:
            records = [_record(db, c.req_id)[0] for c in clients]
            assert not any(r.is_terminal for r in records), "a request ended before the kill"
            return (min(len(r.token_ids) for r in records) >= NUM_TOKENS_AT_KILL and reads[2].done()
                    and all(_has_multi_token_offsets(r) for r in records))

        await _until(ready_to_kill, 120, "tokens and accepted drafts before the kill")
        victim = _heartbeat(db, scheduler_id)
        os.kill(int(victim["pid"]), signal.SIGKILL)
        reads[1].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reads[1]
        reads[1] = asyncio.create_task(at_once.read(session, url))

        def taken_over_and_on() -> bool:
            record, raw = _record(db, late.req_id)
            return b"resumed_from_seq" in raw and record.seq >= int(raw[b"resumed_from_seq"]) + 2

        await _until(taken_over_and_on, 120, f"{late.req_id} resumed by the restarted scheduler")
        reads[2] = asyncio.create_task(late.read(session, url))
        await asyncio.wait_for(asyncio.gather(*reads), 180)
        await _until(lambda: _heartbeat(db, scheduler_id)["pid"] != victim["pid"]
                     and _accepted(_heartbeat(db, scheduler_id)) > 0, 15, "the new scheduler's heartbeat")
        async with session.get(f"{url}/metrics") as response:
            metrics = await response.text()
        replays = [await _replay_after_first_multi_token_event(session, url, client) for client in clients]
    records, raws = zip(*(_record(db, c.req_id) for c in clients), strict=True)
    return KillRun(undisturbed, clients, replays, list(records),
                   [int(raw.get(b"resumed_from_seq", 0)) for raw in raws], accepted_undisturbed,
                   _accepted(_heartbeat(db, scheduler_id)),
                   sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                       if line.startswith("tokenfleet:spec_decode_num_accepted_tokens_total{")))


async def _replay_after_first_multi_token_event(session: aiohttp.ClientSession, url: str,
                                                client: EventsClient) -> EventsClient:
    """The request's events read again from the record, with Last-Event-ID the seq of its
    first event of several tokens."""
    first = next(i for i, e in enumerate(client.events) if len(e["token_ids"]) > 1)
    replay = EventsClient(client.req_id, events=client.events[:first + 1],
                          resumes=[r for r in client.resumes if r[0] <= first])
    await replay.read(session, url)
    return replay


def _check_events(client: EventsClient, record: ResultRecord, want_token_ids: list[int],
                  want_text: str) -> None:
    """One request's events, across its reconnects: each is the record's output between the
    event before it and its own seq (the schedulers' offsets); consecutive seqs, but for the
    catch-up a reconnect may open with; the tokens and text together the undisturbed run's,
    ended once."""
    ends = [(0, 0), *map(tuple, record.offsets)]  # seq -> (tokens, characters) delivered after it
    resumes = dict(client.resumes)
    before = 0
    for index, data in enumerate(client.events):
        seq = data["seq"]
        assert seq == before + 1 or (index in resumes and seq > before), (client.req_id, before, seq)
        (num_tokens, num_chars), (upto_tokens, upto_chars) = ends[before], ends[seq]
        assert data["token_ids"] == record.token_ids[num_tokens:upto_tokens], (client.req_id, seq)
        assert data["text"] == record.text[num_chars:upto_chars], (client.req_id, seq)
        before = seq
    assert client.is_done and before == record.seq
    assert [e["status"] for e in client.events if e["status"] is not None] == ["completed"]
    assert sum((e["token_ids"] for e in client.events), []) == want_token_ids
    assert "".join(e["text"] for e in client.events) == want_text


def _joined(client: EventsClient) -> tuple[list[int], str]:
    return sum((e["token_ids"] for e in client.events), []), "".join(e["text"] for e in client.events)


def test_chats_killed_and_resumed_with_speculation_give_the_undisturbed_greedy_text(smollm2, tmp_path):
    port = free_port()
    home = tmp_path / "home"
    # Leases of 2 s: the scheduler `up` starts again takes its requests back soon after it is up.
    # One torch thread: two thrash on this machine's two cores, shared with the other processes.
    up = UpProcess(["--port", str(port), "--model", str(smollm2), "--num-kv-blocks", "128",
                    "--dtype", "float32", "--gateway-workers", "1", "--device", "cpu", "--num-threads", "1",
                    "--speculative-config", RESUME_SPEC], home, TOKENFLEET_LEASE_S="2")
    try:
        up.wait_up()
        db = redis.Redis.from_url(json.loads((home / "fleet.json").read_text())["redis_url"])
        run = asyncio.run(_kill_mid_stream(f"http://127.0.0.1:{port}", smollm2.name, db))
    finally:
        assert up.stop() == 0, up.output[-3000:]
    assert run.accepted_undisturbed > 0
    assert run.accepted_after_kill > 0 and run.metrics_accepted > 0
    runs = zip(run.undisturbed, run.clients, run.replays, run.records, run.resumed_from_seq, strict=True)
    for reference, client, replay, record, resumed_from in runs:
        want_token_ids, want_text = _joined(reference)
        assert [e["seq"] for e in reference.events] == list(range(1, reference.last_seq + 1))
        assert record.state == "completed" and 0 < resumed_from < record.seq
        assert record.token_ids == want_token_ids and record.text == want_text
        _check_events(client, record, want_token_ids, want_text)
        _check_events(replay, record, want_token_ids, want_text)
        # Drafts accepted on both sides of the kill go out as one event each.
        assert any(len(e["token_ids"]) > 1 for e in client.events if e["seq"] <= resumed_from)
        assert any(len(e["token_ids"]) > 1 for e in client.events if e["seq"] > resumed_from)
    stays, _, late = run.clients
    assert [e["seq"] for e in stays.events] == list(range(1, stays.last_seq + 1)) and not stays.resumes
    ((_, late_after),) = late.resumes  # it left just after an event of several tokens
    assert len(next(e for e in late.events if e["seq"] == late_after)["token_ids"]) > 1
