"""kill -9 of a scheduler process mid-generation: a second one finishes its requests, and
every client-visible event stream has no gap and no repeat."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from tests.fleet_helpers import start_scheduler, stop_schedulers, wait_heartbeat
from tests.scheduler.service_client import KEYS, EventRecorder, submit, token_ids, wait_terminal

pytestmark = pytest.mark.slow
MODEL = "smol"
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain.",
             "What is 2 + 2?", "Describe a cat.", "Why is the sky blue?", "Say hello in Spanish.",
             "List two planets."]
# The tiny model makes a token in a few ms: long enough that the kill, within a poll (20 ms) of
# every request's fourth token, finds them all unfinished.
NUM_TOKENS = 128
SAMPLING = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def _start_scheduler(model, url: str, name: str) -> subprocess.Popen:
    return start_scheduler(url, model, name, "--lease-s", "2", "--num-kv-blocks", "256",
                           "--max-num-seqs", "8", model_name=MODEL)


def test_kill_9_scheduler_mid_generation_successor_finishes_without_gap_or_repeat(tiny_chat, redis_server):
    with LLMEngine(EngineConfig(model=str(tiny_chat), dtype="float32", num_kv_blocks=256)) as engine:
        prompts = [engine.encode(q, chat=True) for q in QUESTIONS]
        undisturbed = [r.text for r in engine.generate(prompts, SAMPLING)]
    client = redis_server.client()
    recorder = EventRecorder(redis_server.url)
    victim = _start_scheduler(tiny_chat, redis_server.url, "victim")
    survivor = None
    try:
        wait_heartbeat(client, "victim", victim)
        ids = [submit(client, MODEL, p, SAMPLING) for p in prompts]
        # Mid-generation: every request has started on the victim, none has finished.
        while min(len(token_ids(client.hgetall(KEYS.result(r)))) for r in ids) < 4:
            time.sleep(0.02)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        started = {r: len(token_ids(client.hgetall(KEYS.result(r)))) for r in ids}
        assert all(0 < n < NUM_TOKENS for n in started.values()), started
        survivor = _start_scheduler(tiny_chat, redis_server.url, "survivor")
        records = wait_terminal(client, ids, timeout_s=300)
    finally:
        stop_schedulers(victim, survivor)
        recorder.close()
    for req_id, want in zip(ids, undisturbed, strict=True):
        record = records[req_id]
        assert record[b"state"] == b"completed"
        assert record[b"scheduler"] == b"survivor"
        events = recorder.events[req_id]
        assert [e.seq for e in events] == list(range(1, len(events) + 1))  # no gap, no repeat
        assert "".join(e.text for e in events) == want == record[b"text"].decode()
        assert len(sum((e.token_ids for e in events), [])) == NUM_TOKENS
