"""A per-rank weight budget: a model too big for one rank is refused before any weight is
allocated, and loads once tensor parallelism shards it (the 28 GB model on 24 GB cards case)."""

from __future__ import annotations

import random

import pytest

from shared.config import EngineConfig
from shared.errors import ModelLoadError
from shared.sampling import SamplingParams
from workers.model_runner import ModelRunner, format_bytes
from workers.parallel import SINGLE_DEVICE, TensorParallel


def _config(folder, **overrides) -> EngineConfig:
    base = dict(model=str(folder), dtype="float32", device="cpu", block_size=4, num_kv_blocks=16)
    return EngineConfig(**{**base, **overrides})


def test_weight_bytes_needed_are_what_each_rank_loads(tiny_checkpoints) -> None:
    folder = tiny_checkpoints["qwen2"]
    runner = ModelRunner(_config(folder), SINGLE_DEVICE)
    assert runner.weight_bytes_needed() == runner.weight_bytes
    for rank in range(2):
        shard = ModelRunner(_config(folder, tp=2), TensorParallel(rank=rank, size=2))
        assert shard.weight_bytes_needed() == shard.weight_bytes
        assert shard.weight_bytes < 0.6 * runner.weight_bytes


def test_budget_below_the_whole_model_is_refused_at_tp1_before_loading(tiny_checkpoints, monkeypatch) -> None:
    folder = tiny_checkpoints["qwen2"]
    full = ModelRunner(_config(folder), SINGLE_DEVICE).weight_bytes
    budget = int(0.6 * full)

    def must_not_load(*args, **kwargs):
        raise AssertionError("weights were loaded before the budget check")

    monkeypatch.setattr("workers.runner_build.load_weights", must_not_load)
    with pytest.raises(ModelLoadError, match="max_weight_bytes_per_rank") as info:
        ModelRunner(_config(folder, max_weight_bytes_per_rank=budget), SINGLE_DEVICE)
    message = str(info.value)
    assert "tp=1" in message and format_bytes(full) in message and format_bytes(budget) in message


def test_same_budget_admits_each_tp2_shard(tiny_checkpoints) -> None:
    folder = tiny_checkpoints["qwen2"]
    full = ModelRunner(_config(folder), SINGLE_DEVICE).weight_bytes
    budget = int(0.6 * full)
    for rank in range(2):
        shard = ModelRunner(_config(folder, tp=2, max_weight_bytes_per_rank=budget),
                            TensorParallel(rank=rank, size=2))
        assert shard.weight_bytes <= budget


@pytest.mark.slow
def test_engine_serves_at_tp2_under_a_budget_tp1_refuses(tiny_checkpoints) -> None:
    from scheduler.engine import LLMEngine

    folder = tiny_checkpoints["qwen2"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 30))] for _ in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLMEngine(_config(folder, num_kv_blocks=128)) as engine:
        full = engine.executor.rank_weight_bytes()[0]
        expected = [r.token_ids for r in engine.generate(prompts, greedy)]
    budget = int(0.6 * full)
    with pytest.raises(ModelLoadError, match="max_weight_bytes_per_rank"):
        LLMEngine(_config(folder, num_kv_blocks=128, max_weight_bytes_per_rank=budget))
    with LLMEngine(_config(folder, num_kv_blocks=128, tp=2, max_weight_bytes_per_rank=budget)) as engine:
        assert max(engine.executor.rank_weight_bytes()) <= budget
        assert [r.token_ids for r in engine.generate(prompts, greedy)] == expected
