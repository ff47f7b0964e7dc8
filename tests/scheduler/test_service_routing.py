"""Requests routed to one replica's own stream are never stranded: a peer takes them over when
the replica dies (its unread entries and its pending ones), and an idle peer takes them once
they have waited longer than the bound behind a busy replica."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from protocol.keys import CONSUMER_GROUP
from protocol.messages import RequestMessage
from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from tests.fleet_helpers import start_scheduler, stop_schedulers, wait_heartbeat
from tests.scheduler.service_client import KEYS, EventRecorder, token_ids, wait_terminal

pytestmark = pytest.mark.slow
MODEL = "smol"
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain.",
             "What is 2 + 2?", "Describe a cat.", "Why is the sky blue?"]
NUM_TOKENS = 200
SAMPLING = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
LONG_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)


def _submit_routed(client, scheduler_id: str, prompt: list[int],
                   sampling: SamplingParams) -> tuple[str, float]:
    """As the gateway queues a request it routed to `scheduler_id`: into that one's own stream."""
    req_id = uuid.uuid4().hex
    now = time.time()
    message = RequestMessage.make(req_id, MODEL, prompt, sampling, arrival_time=now)
    client.xadd(KEYS.replica_stream(MODEL, scheduler_id), {"m": message.encode()})
    return req_id, now


def _unread(client, stream: str) -> int:
    return client.xlen(stream) - client.xpending(stream, CONSUMER_GROUP)["pending"]


def _start(model: Path, url: str, name: str, log_dir: Path, *args: str) -> subprocess.Popen:
    return start_scheduler(url, model, name, "--lease-s", "2", "--num-kv-blocks", "512", *args,
                           model_name=MODEL, log_dir=log_dir)


@pytest.fixture(scope="module")
def undisturbed(tiny_chat) -> tuple[list[list[int]], list[str]]:
    with LLMEngine(EngineConfig(model=str(tiny_chat), dtype="float32", num_kv_blocks=256)) as engine:
        prompts = [engine.encode(q, chat=True) for q in QUESTIONS]
        return prompts, [r.text for r in engine.generate(prompts, SAMPLING)]


@pytest.fixture(scope="module")
def undisturbed_long(tiny_chat, undisturbed) -> list[str]:
    """The first two prompts' greedy text at LONG_SAMPLING."""
    prompts, _ = undisturbed
    with LLMEngine(EngineConfig(model=str(tiny_chat), dtype="float32", num_kv_blocks=256)) as engine:
        return [r.text for r in engine.generate(prompts[:2], LONG_SAMPLING)]


def test_kill_9_with_requests_waiting_in_its_own_stream_a_peer_finishes_each_once(
        tiny_chat, redis_server, undisturbed, undisturbed_long, tmp_path):
    """The victim runs two long requests routed to it; it is stopped (SIGSTOP: it reads nothing
    more) and four more are routed to it, waiting unread in its own stream; then it is killed -9.
    The survivor (which would never steal them: --steal-after-s 600) reads the four once the
    victim's heartbeat is gone and resumes the two after the lease. Every request completes on
    the survivor, greedy-identical, its events with no gap and no repeat."""
    prompts, want = undisturbed
    want = undisturbed_long + want[2:]
    client = redis_server.client()
    recorder = EventRecorder(redis_server.url)
    victim = _start(tiny_chat, redis_server.url, "victim", tmp_path, "--max-num-seqs", "2")
    survivor = _start(tiny_chat, redis_server.url, "survivor", tmp_path, "--max-num-seqs", "8",
                      "--steal-after-s", "600")
    stream = KEYS.replica_stream(MODEL, "victim")
    try:
        wait_heartbeat(client, "victim", victim)
        wait_heartbeat(client, "survivor", survivor)
        # Long enough (seconds) that neither finishes before the victim is stopped.
        ids = [_submit_routed(client, "victim", p, LONG_SAMPLING)[0] for p in prompts[:2]]
        while sum(len(token_ids(client.hgetall(KEYS.result(r)))) >= 4 for r in ids) < 2:
            time.sleep(0.02)
        os.killpg(victim.pid, signal.SIGSTOP)
        ids += [_submit_routed(client, "victim", p, SAMPLING)[0] for p in prompts[2:]]
        assert _unread(client, stream) == 4  # waiting in its own stream
        assert all(client.hget(KEYS.result(r), "state") == b"running" for r in ids[:2])
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        records = wait_terminal(client, ids, timeout_s=300)
        # The dead replica's stream, empty now, is forgotten by its peers (once it looked dead 30 s).
        deadline = time.monotonic() + 60
        while client.sismember(KEYS.replica_streams(MODEL), "victim") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not client.sismember(KEYS.replica_streams(MODEL), "victim")
        assert not client.exists(KEYS.replica_stream(MODEL, "victim"))
        time.sleep(1.5)  # a heartbeat with the counts
        heartbeat = client.hgetall(KEYS.scheduler("survivor"))
    finally:
        stop_schedulers(victim, survivor)
        recorder.close()
    for req_id, text in zip(ids, want, strict=True):
        record = records[req_id]
        assert record[b"state"] == b"completed"
        assert record[b"scheduler"] == b"survivor"
        events = recorder.events[req_id]
        assert [e.seq for e in events] == list(range(1, len(events) + 1))  # no gap, no repeat
        assert "".join(e.text for e in events) == text == record[b"text"].decode()
    assert int(heartbeat[b"entries_stolen"]) == len(ids)
    assert client.xlen(KEYS.dead) == 0


def test_an_idle_peer_drains_an_overloaded_replicas_own_stream_within_the_bound(
        tiny_chat, redis_server, undisturbed, tmp_path):
    """`busy` has one slot, taken by a long request; five more routed to it wait in its own
    stream. `idle` takes each of them after it waited the bound (1 s) and within the bound plus
    one maintenance interval (0.5 s) and some slack for a loaded machine."""
    prompts, want = undisturbed
    steal_after_s, heartbeat_s = 1.0, 0.5
    client = redis_server.client()
    flags = ("--steal-after-s", str(steal_after_s), "--heartbeat-s", str(heartbeat_s))
    busy = _start(tiny_chat, redis_server.url, "busy", tmp_path, "--max-num-seqs", "1", *flags)
    idle = _start(tiny_chat, redis_server.url, "idle", tmp_path, "--max-num-seqs", "8", *flags)
    try:
        wait_heartbeat(client, "busy", busy)
        wait_heartbeat(client, "idle", idle)
        long_id, _ = _submit_routed(client, "busy", prompts[0],
                                    SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True))
        while client.hget(KEYS.result(long_id), "scheduler") != b"busy":
            time.sleep(0.02)
        queued = [_submit_routed(client, "busy", p, SAMPLING) for p in prompts[1:]]
        records = wait_terminal(client, [r for r, _ in queued], timeout_s=120)
        client.set(KEYS.cancelled(long_id), 1)
        client.publish(KEYS.cancel_channel, long_id)
        wait_terminal(client, [long_id], timeout_s=120)
    finally:
        stop_schedulers(busy, idle)
    for (req_id, queued_at), text in zip(queued, want[1:], strict=True):
        record = records[req_id]
        assert record[b"scheduler"] == b"idle" and record[b"state"] == b"completed"
        assert record[b"text"].decode() == text
        waited = float(record[b"started_at"]) - queued_at
        assert steal_after_s - 0.1 <= waited <= steal_after_s + heartbeat_s + 2.0, waited
