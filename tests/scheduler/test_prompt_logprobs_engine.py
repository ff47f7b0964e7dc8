"""Prompt logprobs through the whole engine (scheduler + real runner) against transformers'
log-softmax of the same prompt: SmolLM2 in float32 on this CPU, in one prefill, in chunks much
shorter than the prompt, and when another request has put part of the prompt in the prefix cache.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams

TOP_N = 3
# float32 on both sides; the same tolerance the logits tests use, taken on logprobs.
ATOL = 1e-3


@pytest.fixture(scope="module")
def hf_model(smollm2):
    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


def hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the log-softmax predicting prompt token i + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return logits[:-1].log_softmax(dim=-1)


def run(smollm2, prompts: list[list[int]], params: list[SamplingParams], **config) -> list[list]:
    """The prompt_logprobs each request's outputs carried (None where none came)."""
    settings = dict(model=str(smollm2), dtype="float32", block_size=16, num_kv_blocks=128,
                    max_num_seqs=4, max_num_batched_tokens=64)
    settings.update(config)
    with LLMEngine(EngineConfig(**settings)) as engine:
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        got: dict[str, list | None] = dict.fromkeys(ids)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.prompt_logprobs is not None:
                    assert got[out.req_id] is None, "prompt logprobs sent twice"
                    got[out.req_id] = out.prompt_logprobs
        return [got[i] for i in ids], engine.scheduler.block_manager


def assert_matches(entries: list, prompt: list[int], ref: torch.Tensor, top_n: int) -> None:
    assert len(entries) == len(prompt)
    assert entries[0] == [prompt[0], None, None]
    for i, (token_id, logprob, top) in enumerate(entries[1:]):
        assert token_id == prompt[i + 1]
        assert abs(logprob - float(ref[i, token_id])) < ATOL, f"position {i + 1}"
        values, top_ids = ref[i].topk(top_n)
        assert [t for t, _ in top] == top_ids.tolist() or _near_tie(values), f"position {i + 1}"
        for (t, lp) in top:
            assert abs(lp - float(ref[i, t])) < ATOL


def _near_tie(values: torch.Tensor) -> bool:
    return bool((values[:-1] - values[1:]).min() < 1e-4)


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


@pytest.mark.slow
def test_prompt_logprobs_match_transformers_in_one_prefill_and_in_chunks(smollm2, hf_model) -> None:
    """A 150-token prompt in one prefill, then in chunks of at most 40 tokens (several steps, each
    scoring its own rows), beside a short one."""
    long_prompt, short_prompt = prompt_of(1, 150), prompt_of(2, 23)
    params = [SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP_N),
              SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)]
    for budget in (256, 40):
        (long_entries, short_entries), _ = run(smollm2, [long_prompt, short_prompt], params,
                                               max_num_batched_tokens=budget)
        assert_matches(long_entries, long_prompt, hf_prompt_logprobs(hf_model, long_prompt), TOP_N)
        assert all(top is None for _, _, top in short_entries)
        ref = hf_prompt_logprobs(hf_model, short_prompt)
        for i, (_, logprob, _) in enumerate(short_entries[1:]):
            assert abs(logprob - float(ref[i, short_prompt[i + 1]])) < ATOL


@pytest.mark.slow
def test_prompt_logprobs_are_whole_when_part_of_the_prompt_is_cached(smollm2, hf_model) -> None:
    """The first request caches a 64-token prefix; the second shares it and asks for prompt
    logprobs: it computes its whole prompt (the cached positions have no logits), and every
    position matches transformers. A third, without prompt logprobs, still hits the cache."""
    prefix = prompt_of(3, 64)
    first, second, third = prefix + prompt_of(4, 10), prefix + prompt_of(5, 30), prefix + prompt_of(6, 5)
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    with LLMEngine(EngineConfig(model=str(smollm2), dtype="float32", block_size=16, num_kv_blocks=128,
                                max_num_seqs=4, max_num_batched_tokens=64)) as engine:
        entries = {}
        for prompt, sp in ((first, greedy), (second, SamplingParams(temperature=0.0, max_tokens=2,
                                                                    prompt_logprobs=TOP_N)), (third, greedy)):
            req_id = engine.add_request(prompt, sp)
            request = engine.scheduler.get_request(req_id)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.prompt_logprobs is not None:
                        entries[req_id] = out.prompt_logprobs
            entries.setdefault(req_id, None)
            if prompt is second:
                assert request.num_cached_tokens == 0
                assert_matches(entries[req_id], second, hf_prompt_logprobs(hf_model, second), TOP_N)
            elif prompt is third:
                assert request.num_cached_tokens == 64
                assert entries[req_id] is None
