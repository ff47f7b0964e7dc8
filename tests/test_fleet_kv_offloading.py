"""The host KV tier through a real `tokenfleet up --kv-offloading-size`, called with the openai SDK:
a conversation pushed out of a small GPU cache by other prompts comes back from the host, its
`usage.prompt_tokens_details.cached_tokens` counting the host hit and its text the in-process
engine's without the tier; the scheduler's heartbeat shows the tier."""

from __future__ import annotations

import json
import random
import time

import openai
import pytest
import redis

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.net import free_port
from shared.sampling import SamplingParams
from tests.fleet_helpers import KEYS, TINY_CHAT, UpProcess
from tokenfleet.cli import main

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def _prompts() -> tuple[list[int], list[list[int]], list[int]]:
    """A first turn (160 tokens), three unrelated prompts (200 each: with their outputs, more than
    the 32 blocks of 16 the GPU cache holds) and the second turn (the first plus 20 tokens)."""
    rng = random.Random(2)
    tokens = lambda n: [rng.randrange(100, 40000) for _ in range(n)]  # noqa: E731
    first = tokens(160)
    return first, [tokens(200) for _ in range(3)], first + tokens(20)


def test_a_conversation_comes_back_from_the_host_tier_through_up(tiny_chat, tmp_path, capsys) -> None:
    first, others, second = _prompts()
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLMEngine(EngineConfig(model=str(tiny_chat), dtype="float32", num_kv_blocks=32)) as engine:
        expected = engine.generate([second], greedy)[0].text
    port = free_port()
    home = tmp_path / "home"
    up = UpProcess(["--port", str(port), "--model", str(tiny_chat), "--num-kv-blocks", "32", "--dtype",
                    "float32", "--gateway-workers", "1", "--device", "cpu", "--kv-offloading-size", "0.05"],
                   home)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    try:
        up.wait_up()
        for prompt in [first, *others]:
            client.completions.create(model=TINY_CHAT, prompt=prompt, **sampling)
        completion = client.completions.create(model=TINY_CHAT, prompt=second, **sampling)
        assert completion.choices[0].text == expected
        # The first turn's full blocks (160 tokens) came back: from the host, as the GPU cache held
        # 32 blocks and the three prompts after it needed 39.
        assert completion.usage.prompt_tokens_details.cached_tokens == 160
        beat_key = KEYS.scheduler(f"{TINY_CHAT}-0")
        beats = redis.Redis.from_url(json.loads((home / "fleet.json").read_text())["redis_url"])
        deadline = time.monotonic() + 30
        while int(beats.hget(beat_key, "host_kv_hit_tokens") or 0) < 160:  # (the next heartbeat's)
            assert time.monotonic() < deadline, beats.hgetall(beat_key)
            time.sleep(0.2)
        assert int(beats.hget(beat_key, "num_host_kv_blocks")) > 0
        # `tokenfleet status` shows the tier beside the GPU cache's use.
        redis_url = json.loads((home / "fleet.json").read_text())["redis_url"]
        assert main(["status", "--redis-url", redis_url]) == 0
        out = capsys.readouterr().out
        assert [line for line in out.splitlines() if f"{TINY_CHAT}-0" in line and "+host" in line
                and "hit tok" in line], out
    finally:
        assert up.stop() == 0, up.output[-3000:]
