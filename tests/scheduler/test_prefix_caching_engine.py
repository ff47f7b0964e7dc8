"""Prefix caching in the whole engine (scheduler core + real runner): greedy outputs with the
cache are token-identical to outputs without it, on prompts sharing prefixes, while a tiny
KV cache forces preemption, prefill runs in small chunks, or two TP ranks share block tables.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from tests.hf_reference import assert_greedy_matches, hf_greedy

NUM_NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)

# Needs two ranks; on a CUDA host with one GPU, NCCL refuses two ranks on it.
needs_two_ranks = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="TP=2 needs two GPUs on CUDA"
)


def shared_prefix_prompts(seed: int, vocab: int) -> list[list[int]]:
    """Two system prompts (37 and 21 tokens), distinct user turns after them, one prompt
    sent twice (a full hit: only its last token is recomputed) and one sharing nothing."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    system_a, system_b = tokens(37), tokens(21)
    prompts = [system_a + tokens(n) for n in (5, 12, 1, 30)]
    prompts += [system_b + tokens(n) for n in (9, 2)]
    prompts += [list(prompts[0]), tokens(17)]
    return prompts


def run(folder, prompts: list[list[int]], caching: bool, **overrides):
    """(tokens per prompt, the requests as the scheduler left them, the block manager)."""
    config = dict(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=3,
                  max_num_batched_tokens=16, enable_prefix_caching=caching)
    config.update(overrides)
    with LLMEngine(EngineConfig(**config)) as engine:
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        requests = [engine.scheduler.get_request(i) for i in ids]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.req_id].extend(out.new_token_ids)
    return [tokens[i] for i in ids], requests, engine.scheduler.block_manager


def assert_same_with_and_without_cache(folder, **overrides):
    prompts = shared_prefix_prompts(7, 512)
    without, _, _ = run(folder, prompts, caching=False, **overrides)
    with_cache, requests, manager = run(folder, prompts, caching=True, **overrides)
    assert manager.prefix_cache_hits > 0, "no request was served from the cache"
    assert manager.prefix_cache_queries == sum(map(len, prompts))
    assert manager.prefix_cache_hits == sum(r.num_cached_tokens for r in requests)
    assert with_cache == without
    return prompts, with_cache, requests


def test_cached_prefixes_match_recomputing_and_transformers_with_small_prefill_chunks(tiny_checkpoints):
    folder = tiny_checkpoints["qwen2"]
    prompts, tokens, requests = assert_same_with_and_without_cache(folder, max_num_batched_tokens=8)
    assert requests[6].num_cached_tokens == 40  # the repeated prompt: all full blocks but its last
    # And against transformers itself, for the requests that were served from the cache.
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, ours, request in zip(prompts, tokens, requests, strict=True):
        if request.num_cached_tokens:
            assert_greedy_matches(ours, hf_greedy(hf, prompt, NUM_NEW_TOKENS), allow_near_tie=True)


def test_cached_prefixes_match_recomputing_under_preemption_by_a_tiny_kv_cache(tiny_checkpoints):
    # 24 blocks of 4 = 96 slots; three running sequences need up to 3 * 83.
    _, _, requests = assert_same_with_and_without_cache(tiny_checkpoints["qwen2"], num_kv_blocks=24)
    assert sum(r.num_preemptions for r in requests) > 0, "no preemption was forced"


@pytest.mark.slow
@needs_two_ranks
def test_cached_prefixes_match_recomputing_at_tp2(tiny_checkpoints):
    assert_same_with_and_without_cache(tiny_checkpoints["llama"], tp=2)
