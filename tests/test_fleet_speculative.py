"""Speculative decoding through the fleet, on SmolLM2's real weights: `tokenfleet up
--speculative-config` streams a chat that copies a passage, whose greedy text equals the
in-process engine's without speculation, and the scheduler's heartbeat counts accepted drafts."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
import redis

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.net import free_port
from shared.sampling import SamplingParams
from testkit.spec_runs import COPY_PROMPTS
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
