"""The whole in-process engine (scheduler core + runner) against transformers' greedy output.

Each test drives the engine into one of the situations that break naive engines, with
prompts of different lengths batched together: chunked prefill forced small, requests
joining mid-generation, preemption forced by a tiny KV cache, tensor parallelism.
"""

from __future__ import annotations

import random
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from testkit.checkpoints import TINY_ARCHS
from tests.hf_reference import assert_greedy_matches, hf_greedy
from tests.workers.runner_refs import alive, runner_weakrefs

NUM_NEW_TOKENS = 32


def _prompts(seed: int, vocab: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _references(folder, prompts: list[list[int]], max_new_tokens: int = NUM_NEW_TOKENS):
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return [hf_greedy(hf, p, max_new_tokens) for p in prompts]


def _engine(folder, **overrides) -> LLMEngine:
    config = dict(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=3,
                  max_num_batched_tokens=16)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
LENGTHS = [5, 41, 1, 17, 63, 9]  # mixed lengths; 63 > the 16-token budget, so it is chunked


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_matches_transformers_batched_chunked_and_joining(arch: str, tiny_checkpoints) -> None:
    """6 prompts, at most 3 running: later ones join while others decode; prefill in 16-token
    chunks; every output equals transformers' greedy continuation."""
    folder = tiny_checkpoints[arch]
    prompts = _prompts(1, 512, LENGTHS)
    refs = _references(folder, prompts)
    with _engine(folder) as engine:
        results = engine.generate(prompts, GREEDY)
    for result, ref in zip(results, refs, strict=True):
        assert_greedy_matches(result.token_ids, ref, allow_near_tie=True)
        assert result.finish_reason.value == "length"
        assert result.usage.completion_tokens == NUM_NEW_TOKENS


def test_greedy_matches_under_preemption_by_tiny_kv_cache(tiny_checkpoints) -> None:
    folder = tiny_checkpoints["qwen2"]
    prompts = _prompts(2, 512, LENGTHS)
    refs = _references(folder, prompts)
    # 30 blocks of 4 = 120 slots; the three running sequences need up to 3 * 95.
    with _engine(folder, num_kv_blocks=30) as engine:
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        requests = [engine.scheduler.get_request(i) for i in ids]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.req_id].extend(out.new_token_ids)
    assert sum(r.num_preemptions for r in requests) > 0, "the tiny cache never forced a preemption"
    for req_id, ref in zip(ids, refs, strict=True):
        assert_greedy_matches(tokens[req_id], ref, allow_near_tie=True)


def test_request_added_mid_generation_matches(tiny_checkpoints) -> None:
    folder = tiny_checkpoints["llama"]
    first, late = _prompts(3, 512, [30, 22])
    refs = _references(folder, [first, late])
    with _engine(folder, max_num_seqs=8) as engine:
        a = engine.add_request(first, GREEDY)
        tokens: dict[str, list[int]] = {a: []}
        for _ in range(6):
            for out in engine.step():
                tokens[out.req_id].extend(out.new_token_ids)
        assert 0 < len(tokens[a]) < NUM_NEW_TOKENS
        b = engine.add_request(late, GREEDY)
        tokens[b] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.req_id].extend(out.new_token_ids)
    assert_greedy_matches(tokens[a], refs[0], allow_near_tie=True)
    assert_greedy_matches(tokens[b], refs[1], allow_near_tie=True)


# NCCL refuses two ranks on one GPU; on a CUDA host with one GPU, TP=2 cannot run.
needs_two_ranks = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="TP=2 needs two GPUs on CUDA"
)


@pytest.mark.slow
@needs_two_ranks
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "smollm_tied"])
def test_tp2_greedy_matches_transformers(arch: str, tiny_checkpoints) -> None:
    folder = tiny_checkpoints[arch]
    prompts = _prompts(4, 512, LENGTHS)
    refs = _references(folder, prompts)
    with _engine(folder, tp=2) as engine:
        results = engine.generate(prompts, GREEDY)
    for result, ref in zip(results, refs, strict=True):
        assert_greedy_matches(result.token_ids, ref, allow_near_tie=True)


SMOLLM2_PROMPTS = _prompts(5, 49152, [7, 120, 33, 300, 2])


@pytest.fixture(scope="module")
def smollm2_references(smollm2):
    """transformers' greedy continuations of SMOLLM2_PROMPTS, computed once for every TP."""
    return _references(smollm2, SMOLLM2_PROMPTS)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=needs_two_ranks)])
def test_smollm2_greedy_matches_transformers(tp: int, smollm2, smollm2_references) -> None:
    """The real model, no near-tie allowance: every one of 32 tokens identical."""
    prompts, refs = SMOLLM2_PROMPTS, smollm2_references
    with _engine(smollm2, tp=tp, block_size=16, num_kv_blocks=64, max_num_seqs=4,
                 max_num_batched_tokens=64) as engine:
        results = engine.generate(prompts, GREEDY)
    for result, ref in zip(results, refs, strict=True):
        assert_greedy_matches(result.token_ids, ref, allow_near_tie=False)


@pytest.mark.slow
def test_smollm2_chat_answers_paris(smollm2) -> None:
    with LLMEngine(EngineConfig(model=str(smollm2), dtype="float32", num_kv_blocks=64)) as engine:
        [result] = engine.generate(["What is the capital of France?"],
                                   SamplingParams(temperature=0.0, max_tokens=32), chat=True)
    assert "Paris" in result.text
    assert result.finish_reason.value == "stop"  # ended at <|im_end|>, not at max_tokens


@pytest.mark.slow
@needs_two_ranks
@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_tp2_each_rank_holds_about_half_the_weights(which: str, tiny_checkpoints, smollm2) -> None:
    folder = smollm2 if which == "smollm2" else tiny_checkpoints["qwen2"]
    with _engine(folder, tp=1, num_kv_blocks=8) as engine:
        [whole] = engine.executor.rank_weight_bytes()
    with _engine(folder, tp=2, num_kv_blocks=8) as engine:
        shares = engine.executor.rank_weight_bytes()
    assert len(shares) == 2
    for share in shares:
        # SmolLM2's 3 KV heads split 2 + 1, so its ranks hold 53% and 47%.
        assert 0.45 * whole <= share <= 0.55 * whole, (share, whole)
    assert sum(shares) == pytest.approx(whole, rel=0.01)


# -- close -------------------------------------------------------------------------------------


def test_close_frees_the_runner_while_the_engine_and_a_script_still_hold_references(tiny_checkpoints) -> None:
    """What scripts do: keep the engine (a `with` block's name outlives it) and a local of its
    runner. Neither may keep the weights, the KV cache or the sampler once the engine is closed."""
    engine = _engine(tiny_checkpoints["llama"])
    engine.generate(_prompts(6, 512, [7, 19]), GREEDY)
    runner = engine.executor.runner
    refs = runner_weakrefs(runner)
    engine.close()
    assert alive(refs) == []
    assert runner.is_closed and engine.executor.runner is None
    runner_ref = weakref.ref(runner)
    del runner
    assert alive({"runner": runner_ref}) == []  # and nothing else (closures, loggers) holds the runner
    engine.close()  # idempotent


def test_engine_built_after_close_gets_the_same_kv_blocks_and_tokens(tiny_checkpoints) -> None:
    """The second of two engines in one process (bench_gpu.py --max-num-seqs 512,256) is sized
    from the budget the first gave back. On CPU the budget is fixed, so the count is exact; on a
    GPU, test_cuda_paths.py's close test checks it against free memory."""
    prompts = _prompts(7, 512, [5, 30, 12])
    sized_by_budget = dict(device="cpu", num_kv_blocks=None, kv_cache_bytes_cpu=1 << 20)
    with _engine(tiny_checkpoints["qwen2"], **sized_by_budget) as first:
        first_tokens = [r.token_ids for r in first.generate(prompts, GREEDY)]
    with _engine(tiny_checkpoints["qwen2"], **sized_by_budget) as second:
        second_tokens = [r.token_ids for r in second.generate(prompts, GREEDY)]
    assert second.executor.num_kv_blocks == first.executor.num_kv_blocks > 0
    assert second_tokens == first_tokens
