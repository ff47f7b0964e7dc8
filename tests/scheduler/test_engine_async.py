"""The whole engine with async scheduling on (`EngineConfig.async_scheduling`): step n+1 goes
to the runner before step n is collected, its decodes' inputs taken from step n's samples on
the device. Every output (tokens, text, finish and stop reasons, logprobs, usage) equals the
engine's with it off, in each situation that stresses it: chunked prefill and joining, mixed
max_tokens, prefix caching, preemption by a tiny KV cache, seeds and logprobs, penalties, stop
strings and EOS, grammars, tensor parallelism on a Ray group, and a pipeline (which keeps its
own overlap). Each test also checks that steps really were planned ahead (pending inputs)."""

from __future__ import annotations

import json
import random

import pytest

from scheduler.engine import GenerationResult, LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from tests.scheduler.test_engine import needs_two_ranks


def _prompts(seed: int, lengths: list[int], vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


LENGTHS = [5, 41, 1, 17, 63, 9]  # 63 > the 16-token budget: chunked


class PendingCount:
    """Counts, per request, the works submitted with a pending input token."""

    def __init__(self, engine: LLMEngine) -> None:
        self.by_req: dict[str, int] = {}
        self.max_in_flight = 0
        submit = engine.executor.submit

        def counting_submit(batch):
            for work in batch.works:
                self.by_req[work.req_id] = self.by_req.get(work.req_id, 0) + work.is_token_pending
            self.max_in_flight = max(self.max_in_flight, len(engine._in_flight) + 1)
            return submit(batch)

        engine.executor.submit = counting_submit

    @property
    def total(self) -> int:
        return sum(self.by_req.values())


def _generate(folder, prompts, params, *, async_scheduling: bool, with_tokenizer: bool = False,
              **overrides) -> tuple[list[GenerationResult], PendingCount, LLMEngine]:
    config = dict(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=3,
                  max_num_batched_tokens=16, async_scheduling=async_scheduling)
    config.update(overrides)
    with LLMEngine(EngineConfig(**config), load_tokenizer_files=with_tokenizer) as engine:
        count = PendingCount(engine)
        results = engine.generate(prompts, params)
    return results, count, engine


def _assert_same(got: list[GenerationResult], want: list[GenerationResult], logprobs_tol: float = 0.0
                 ) -> None:
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
            w.token_ids, w.text, w.finish_reason, w.stop_reason)
        assert g.usage == w.usage
        if w.logprobs is not None:
            assert [lp.token_id for lp in g.logprobs] == [lp.token_id for lp in w.logprobs]
            for a, b in zip(g.logprobs, w.logprobs, strict=True):
                assert a.logprob == pytest.approx(b.logprob, abs=logprobs_tol)
                assert [t for t, _ in a.top_logprobs or []] == [t for t, _ in b.top_logprobs or []]


def _both(folder, prompts, params, *, steps_ahead: bool | None = True, **kw):
    """Async on and off; `steps_ahead`: whether a step went ahead at some point (None: either)."""
    off, _, _ = _generate(folder, prompts, params, async_scheduling=False, **kw)
    on, count, engine = _generate(folder, prompts, params, async_scheduling=True, **kw)
    assert engine.async_scheduling
    if steps_ahead is not None:
        assert count.max_in_flight == (2 if steps_ahead else 1)
    return on, off, count, engine


def test_chunked_prefill_joining_and_mixed_max_tokens_match_async_off(tiny_checkpoints) -> None:
    prompts = _prompts(1, LENGTHS)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 7, 32, 3, 20, 11)]
    on, off, count, _ = _both(tiny_checkpoints["qwen2"], prompts, params)
    _assert_same(on, off)
    assert [len(r.token_ids) for r in on] == [1, 7, 32, 3, 20, 11]
    assert count.total > 40


def test_prefix_caching_matches_async_off(tiny_checkpoints) -> None:
    shared = _prompts(2, [24])[0]
    prompts = [shared + tail for tail in _prompts(3, [3, 9, 1, 14, 6])]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    on, off, count, engine = _both(tiny_checkpoints["llama"], prompts, greedy)
    _assert_same(on, off)
    assert sum(r.num_cached_tokens for r in on) >= 4 * 24 - 4
    assert engine.scheduler.block_manager.prefix_cache_hits > 0 and count.total > 0


def test_preemption_by_a_tiny_kv_cache_matches_async_off(tiny_checkpoints) -> None:
    prompts = _prompts(2, LENGTHS)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    on, off, count, engine = _both(tiny_checkpoints["qwen2"], prompts, greedy, num_kv_blocks=30)
    _assert_same(on, off)
    assert count.total > 0
    assert engine.scheduler.block_manager.num_free_blocks == 30  # the steps ahead's blocks came back too


def test_seeds_and_logprobs_match_async_off(tiny_checkpoints) -> None:
    prompts = _prompts(4, LENGTHS)
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=100 + i, max_tokens=16,
                             ignore_eos=True, logprobs=3 if i % 2 else 0) for i in range(len(prompts))]
    on, off, count, _ = _both(tiny_checkpoints["qwen3"], prompts, params, num_kv_blocks=40)
    _assert_same(on, off, logprobs_tol=1e-5)
    assert all(len(r.logprobs) == 16 for r in on) and count.total > 0


def test_penalties_match_async_off_with_steps_planned_ahead_of_them(tiny_checkpoints) -> None:
    prompts = _prompts(5, [12, 30, 4, 7])
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, frequency_penalty=0.8),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True, presence_penalty=1.5,
                             frequency_penalty=-0.5, logprobs=2)]
    on, off, count, _ = _both(tiny_checkpoints["llama"], prompts, params)
    _assert_same(on, off, logprobs_tol=1e-5)
    req_ids = [r.req_id for r in on]
    # Their pending token is counted on the device: they go ahead like the free request.
    assert all(count.by_req[req_ids[i]] > 5 for i in (0, 1, 3))


def test_stop_strings_and_eos_match_async_off(tiny_chat) -> None:
    prompts = _prompts(6, [8, 20, 3, 15], vocab=49152)
    free = SamplingParams(temperature=0.0, max_tokens=40)
    [*texts] = [r.text for r in _generate(tiny_chat, prompts, free, async_scheduling=False,
                                          with_tokenizer=True)[0]]
    # Stop strings that occur in the middle of each free-running text, one in a later token.
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop=[t[len(t) // 2: len(t) // 2 + 3]])
              if len(t) > 8 else free for t in texts]
    on, off, count, _ = _both(tiny_chat, prompts, params, with_tokenizer=True)
    _assert_same(on, off)
    assert sum(r.finish_reason.value == "stop" and r.stop_reason is not None for r in on) >= 2
    assert count.total > 0


def test_grammar_rows_match_async_off_with_steps_planned_ahead_of_them(tiny_chat) -> None:
    prompts = _prompts(7, [8, 20, 5], vocab=49152)
    grammar = json.dumps({"type": "json_object"})
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=30, grammar=grammar if i < 2 else None)
              for i in range(3)]
    on, off, count, _ = _both(tiny_chat, prompts, params, with_tokenizer=True, max_num_batched_tokens=32)
    _assert_same(on, off)
    req_ids = [r.req_id for r in on]
    # Their steps ahead sample late, once the step in flight's tokens are accepted by the matchers.
    assert count.by_req[req_ids[0]] > 5 and count.by_req[req_ids[1]] > 5


def test_async_scheduling_is_off_under_a_pipeline_and_by_default_on_cpu(tiny_checkpoints) -> None:
    assert EngineConfig(model="m").async_scheduling is False
    assert EngineConfig.for_device("cuda", model="m").async_scheduling is True
    assert EngineConfig.for_device("cuda", model="m", async_scheduling=False).async_scheduling is False


@pytest.mark.slow
@needs_two_ranks
def test_tp2_on_a_ray_group_matches_async_off(tiny_checkpoints) -> None:
    prompts = _prompts(8, LENGTHS)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=12, ignore_eos=True)
              for i in range(len(prompts))]
    on, off, count, _ = _both(tiny_checkpoints["qwen2"], prompts, params, tp=2)
    _assert_same(on, off)
    assert count.total > 0


@pytest.mark.slow
@needs_two_ranks
def test_tp2_on_a_ray_group_with_grammars_and_penalties_matches_async_off(tiny_chat) -> None:
    """On a Ray group a step cannot sample late (its rank runs it to its end): a constrained
    request waits for its token there, while penalized ones go ahead (their pending token
    counted on the driver rank's device)."""
    prompts = _prompts(10, [8, 20, 5, 11], vocab=49152)
    grammar = json.dumps({"type": "json_object"})
    # The constrained one ends first: no step is planned ahead while it runs, then they go ahead.
    params = [SamplingParams(temperature=0.0, max_tokens=4, grammar=grammar),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, frequency_penalty=0.7),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
    on, off, count, engine = _both(tiny_chat, prompts, params, with_tokenizer=True, tp=2,
                                   max_num_batched_tokens=32, steps_ahead=None)
    assert not engine.executor.samples_late
    _assert_same(on, off)
    req_ids = [r.req_id for r in on]
    assert count.by_req[req_ids[0]] == 0 and count.by_req[req_ids[1]] > 0 and count.by_req[req_ids[2]] > 0


@pytest.mark.slow
def test_pp2_keeps_its_own_overlap_when_async_scheduling_is_asked(tiny_checkpoints) -> None:
    prompts = _prompts(9, LENGTHS)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    off, _, _ = _generate(tiny_checkpoints["llama"], prompts, greedy, async_scheduling=False, pp=2)
    on, count, engine = _generate(tiny_checkpoints["llama"], prompts, greedy, async_scheduling=True, pp=2)
    assert not engine.async_scheduling and count.total == 0 and count.max_in_flight == 2
    _assert_same(on, off)
