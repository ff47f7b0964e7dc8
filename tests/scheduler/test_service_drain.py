"""Draining a scheduler (scale-down): it stops reading, finishes what it runs and exits; what it
cannot finish by the drain's deadline a successor takes over. No request cut, repeated or lost."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from protocol import registry
from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from tests.fleet_helpers import start_scheduler, stop_schedulers, wait_heartbeat
from tests.scheduler.service_client import KEYS, EventRecorder, submit, token_ids, wait_terminal

pytestmark = pytest.mark.slow
MODEL = "smol"
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain.",
             "What is 2 + 2?", "Describe a cat.", "Why is the sky blue?"]
# Long enough that the drain (seen within a maintenance tick, --heartbeat-s 0.2) finds them running
# on a quiet machine too, where the tiny model makes a token in a few ms.
NUM_TOKENS = 600
SAMPLING = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def _start_scheduler(model: Path, url: str, name: str, log_dir: Path) -> subprocess.Popen:
    return start_scheduler(url, model, name, "--lease-s", "5", "--num-kv-blocks", "512",
                           "--max-num-seqs", "4", "--heartbeat-s", "0.2", model_name=MODEL, log_dir=log_dir)


def _owner(client, req_id: str) -> bytes | None:
    return client.hget(KEYS.result(req_id), "scheduler")


@pytest.fixture(scope="module")
def undisturbed(tiny_chat) -> tuple[list[list[int]], list[str]]:
    with LLMEngine(EngineConfig(model=str(tiny_chat), dtype="float32", num_kv_blocks=256)) as engine:
        prompts = [engine.encode(q, chat=True) for q in QUESTIONS]
        return prompts, [r.text for r in engine.generate(prompts, SAMPLING)]


@pytest.mark.parametrize("deadline_passed", [False, True], ids=["finishes_its_own", "hands_over_at_deadline"])
def test_drained_scheduler_stops_reading_and_exits_and_no_stream_is_cut(tiny_chat, redis_server, undisturbed,
                                                                        deadline_passed, tmp_path):
    """Six requests, four slots each: `a` starts four, `b` two. Mid-generation, `a` is told to
    drain. It reads nothing more (a request sent after that runs on `b`), and either finishes
    its four itself or, with its deadline already passed, exits at once leaving them to `b`'s
    takeover. Every event stream is complete with no gap or repeat, the text as undisturbed."""
    prompts, want = undisturbed
    client = redis_server.client()
    recorder = EventRecorder(redis_server.url)
    a = _start_scheduler(tiny_chat, redis_server.url, "a", tmp_path)
    b = _start_scheduler(tiny_chat, redis_server.url, "b", tmp_path)
    try:
        wait_heartbeat(client, "a", a)
        wait_heartbeat(client, "b", b)
        assert sorted(registry.live_members(client, KEYS)[registry.SCHEDULERS]) == ["a", "b"]
        # The four go to `a`'s own stream, as the gateway routes a prefix `a` holds, with `b`
        # already up: the drain then comes while `a` generates however fast it is. (Started
        # after them, `b` once took longer to come up than `a` took over 4 x 600 tokens.)
        own = KEYS.replica_stream(MODEL, "a")
        ids = [submit(client, MODEL, p, SAMPLING, stream=own) for p in prompts[:4]]
        while not all(_owner(client, r) == b"a" for r in ids):
            time.sleep(0.02)
        while min(len(token_ids(client.hgetall(KEYS.result(r)))) for r in ids) < 2:
            time.sleep(0.02)
        client.set(KEYS.drain("a"), repr(time.time() - 1 if deadline_passed else time.time() + 300))
        while client.hget(KEYS.scheduler("a"), "draining") != b"1" and a.poll() is None:
            time.sleep(0.02)
        states = [client.hget(KEYS.result(r), "state") for r in ids]
        assert b"running" in states, states  # the drain came mid-generation
        ids += [submit(client, MODEL, p, SAMPLING) for p in prompts[4:]]
        assert a.wait(timeout=300) == 0  # a loaded machine takes minutes over 4 x 600 tokens
        assert not client.exists(KEYS.scheduler("a"), KEYS.drain("a"))
        assert registry.live_members(client, KEYS)[registry.SCHEDULERS] == ["b"]  # it left the registry
        records = wait_terminal(client, ids, timeout_s=300)
    finally:
        stop_schedulers(a, b)
        recorder.close()
    owners = [records[r][b"scheduler"] for r in ids]
    assert owners[4:] == [b"b", b"b"]  # nothing new was read by the draining scheduler
    assert owners[:4] == ([b"b"] * 4 if deadline_passed else [b"a"] * 4)
    for req_id, text in zip(ids, want, strict=True):
        record = records[req_id]
        assert record[b"state"] == b"completed"
        events = recorder.events[req_id]
        assert [e.seq for e in events] == list(range(1, len(events) + 1))  # no gap, no repeat
        assert "".join(e.text for e in events) == text == record[b"text"].decode()
        assert len(sum((e.token_ids for e in events), [])) == NUM_TOKENS
