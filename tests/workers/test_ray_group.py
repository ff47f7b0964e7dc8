"""Worker groups on a real local Ray: failure recovery and replicas."""

from __future__ import annotations

import os
import random
import signal

import pytest

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _config(folder, **overrides) -> EngineConfig:
    base = dict(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=256,
                max_num_seqs=8, max_num_batched_tokens=32)
    return EngineConfig(**{**base, **overrides})


@pytest.mark.parametrize("victim_rank", [0, 1])
def test_killed_rank_is_rebuilt_and_every_request_completes_identically(victim_rank, tiny_checkpoints):
    folder = tiny_checkpoints["qwen2"]
    prompts = _prompts(6)
    with LLMEngine(_config(folder, tp=2)) as engine:
        undisturbed = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    with LLMEngine(_config(folder, tp=2)) as engine:
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        for _ in range(8):  # mid-generation: prefills done, some tokens out
            for out in engine.step():
                tokens[out.req_id].extend(out.new_token_ids)
        assert any(tokens.values()) and not all(len(t) == 24 for t in tokens.values())
        os.kill(engine.executor.rank_pids()[victim_rank], signal.SIGKILL)
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.req_id].extend(out.new_token_ids)
        assert engine.num_group_restarts == 1
    assert [tokens[i] for i in ids] == undisturbed
