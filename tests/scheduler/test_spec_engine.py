"""Speculative decoding (n-gram) through the whole in-process engine on a tiny random model:
greedy output identical to decoding without it, in mixed batches, under preemption and async
scheduling; and drafts really accepted (a run where none is would prove nothing). Stops and
max_tokens inside an accepted run: tests/scheduler/test_spec_scheduler.py; SmolLM2 through the
fleet: tests/test_fleet_speculative.py."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from scheduler.engine import LLMEngine
from scheduler.engine_metrics import EngineMetrics
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from shared.speculative import SpeculativeConfig
from tests.workers.test_mixed_graphs import fake_mixed_graphs, nan_for_uninitialized  # noqa: F401 - fixtures

# Never backing off: these tests are about verification, and a random model's outputs repeat
# only now and then (the expected-gain rule on a real model: test_spec_chat_gain.py).
NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2,
                          min_speedup=0.0, min_acceptance_rate=0.0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _prompts(seed: int, num_repetitive: int, num_random: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase (so the lookup finds matches), and random ones."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num_repetitive):
        phrase = [rng.randrange(3, 512) for _ in range(8 + i)]
        prompts.append(phrase * 3 + phrase[:3])
    prompts += [[rng.randrange(3, 512) for _ in range(20 + 7 * i)] for i in range(num_random)]
    return prompts


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)  # req_id -> output tokens
    events: dict[str, list[list[int]]] = field(default_factory=dict)  # req_id -> each output's new tokens
    finish: dict[str, tuple] = field(default_factory=dict)  # req_id -> (finish_reason, stop_reason)
    num_preemptions: int = 0
    num_mixed_steps: int = 0  # steps with a decode carrying drafts beside a plain decode
    accepted: int = 0
    drafted: int = 0
    metrics: EngineMetrics | None = None

    def outputs(self) -> list[list[int]]:
        return list(self.tokens.values())


def is_mixed_step(works) -> bool:
    """A step where a decode carrying drafts ran beside a plain decode."""
    return (any(w.num_draft_tokens for w in works)
            and any(len(w.token_ids) == 1 and w.is_sampled for w in works))


class _MixedSteps:
    def __init__(self, run: Run) -> None:
        self.run = run

    def record_step(self, output, outputs, duration_s, result_wait_s=0.0) -> None:
        self.run.metrics.record_step(output, outputs, duration_s, result_wait_s)
        self.run.num_mixed_steps += is_mixed_step(output.batch.works)


def _run(folder, prompts, params, spec: SpeculativeConfig | None, **overrides) -> Run:
    config = dict(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=4,
                  max_num_batched_tokens=32, speculative_config=spec)
    config.update(overrides)
    params = params if isinstance(params, list) else [params] * len(prompts)
    run = Run()
    with LLMEngine(EngineConfig(**config)) as engine:
        run.metrics = EngineMetrics(engine.scheduler, "tiny", "s0")
        engine.step_observer = _MixedSteps(run)
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        requests = [engine.scheduler.get_request(i) for i in ids]
        for i in ids:
            run.tokens[i], run.events[i] = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                run.tokens[out.req_id] += out.new_token_ids
                run.events[out.req_id].append(out.new_token_ids)
                if out.finished:
                    run.finish[out.req_id] = (out.finish_reason, out.stop_reason)
        run.num_preemptions = sum(r.num_preemptions for r in requests)
        if engine.scheduler.speculator is not None:
            run.accepted = engine.scheduler.speculator.num_accepted_tokens
            run.drafted = engine.scheduler.speculator.num_draft_tokens
    return run


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return tiny_checkpoints["llama"]


# Four repetitive prompts, a random one that does not speculate (it asks for logprobs), and a
# repetitive one that samples (its output is not compared: it checks that sampled requests
# speculate and keep max_tokens; their distribution is tests/workers/test_spec_verify.py's).
PROMPTS = _prompts(1, 4, 1) + _prompts(2, 1)
PARAMS = [GREEDY] * 4 + [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0),
                         SamplingParams(temperature=0.3, max_tokens=32, ignore_eos=True)]
NUM_COMPARED = 5


@pytest.fixture(scope="module")
def plain(tiny) -> Run:
    return _run(tiny, PROMPTS, PARAMS, None, max_num_seqs=6)


@pytest.fixture(scope="module")
def spec(tiny) -> Run:
    return _run(tiny, PROMPTS, PARAMS, NGRAM, max_num_seqs=6)


def test_greedy_identical_with_and_without_speculation_in_a_mixed_batch(plain, spec) -> None:
    """Every greedy output equals plain decoding's, drafts were accepted, steps held speculating
    and plain decodes together, and accepted drafts went out with the target's token as one
    output; the sampled request ended at its max_tokens."""
    assert spec.outputs()[:NUM_COMPARED] == plain.outputs()[:NUM_COMPARED]
    assert spec.accepted > 0, "no draft was ever accepted"
    assert spec.num_mixed_steps > 0
    assert max(len(e) for events in spec.events.values() for e in events) > 1
    assert len(spec.outputs()[-1]) == 32


def test_metrics_count_drafted_accepted_and_emitted_tokens_under_vllms_names(spec) -> None:
    from tokenfleet.status_cli import _speculation

    def value(name: str, **labels) -> float:
        sample = spec.metrics.registry.get_sample_value(
            f"tokenfleet:spec_decode_{name}_total", {"model_name": "tiny", "scheduler": "s0", **labels})
        assert sample is not None, name
        return sample

    drafts, accepted = value("num_drafts"), value("num_accepted_tokens")
    assert value("num_draft_tokens") == spec.drafted and accepted == spec.accepted > 0
    assert value("num_emitted_tokens") == accepted + drafts  # no stop cut a run here
    assert sum(value("num_accepted_tokens_per_pos", position=str(p)) for p in range(4)) == accepted
    assert value("num_lookups") >= drafts  # (a look-up that found nothing carried no drafts)
    assert value("num_resumes") <= value("num_backoffs")
    generated = spec.metrics.registry.get_sample_value(
        "tokenfleet:generation_tokens_total", {"model_name": "tiny", "scheduler": "s0"})
    assert generated == sum(len(t) for t in spec.outputs())
    row = {"spec_num_drafts": drafts, "spec_num_draft_tokens": spec.drafted,
           "spec_num_accepted_tokens": accepted}
    assert _speculation(row) == f"{100 * accepted / spec.drafted:.0f}%/{1 + accepted / drafts:.2f}"
    assert _speculation({}) == "-"


def test_greedy_identical_under_preemption_by_a_tiny_kv_cache(tiny, plain) -> None:
    # 30 blocks of 4 = 120 slots; six running sequences need up to 6 * 62 (and drafts more).
    spec = _run(tiny, PROMPTS, PARAMS, NGRAM, max_num_seqs=6, num_kv_blocks=30)
    assert spec.num_preemptions > 0, "the tiny cache never forced a preemption"
    assert spec.accepted > 0
    assert spec.outputs()[:NUM_COMPARED] == plain.outputs()[:NUM_COMPARED]


def test_greedy_identical_with_async_scheduling(tiny, plain) -> None:
    """Speculating requests wait for their tokens (no step ahead while one would speculate);
    the request that does not speculate runs beside them."""
    spec = _run(tiny, PROMPTS, PARAMS, NGRAM, max_num_seqs=6, async_scheduling=True)
    assert spec.accepted > 0
    assert spec.outputs()[:NUM_COMPARED] == plain.outputs()[:NUM_COMPARED]


@pytest.mark.slow
def test_greedy_identical_with_tp2_through_the_ray_group(tiny, plain) -> None:
    """Every rank scores the drafts (the LM head gathers the vocabulary across ranks); the driver
    verifies, and the accepted counts come back through the group's result."""
    spec = _run(tiny, PROMPTS, PARAMS, NGRAM, max_num_seqs=6, tp=2)
    assert spec.accepted > 0
    assert spec.outputs()[:NUM_COMPARED] == plain.outputs()[:NUM_COMPARED]


def test_lora_requests_speculate_with_their_adapter_on_every_verified_row(tiny, lora_adapters) -> None:
    """Adapters apply to the drafts' rows as to any token's: the base and two adapters, in the same
    steps, speculating, give the tokens of the same engine without speculation."""
    names = [None, *list(lora_adapters)[:2]]
    prompts = PROMPTS[:3]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    config = dict(model=str(tiny), dtype="float32", block_size=4, num_kv_blocks=128, max_num_seqs=4,
                  max_num_batched_tokens=32, enable_lora=True, max_loras=2, max_lora_rank=16,
                  lora_modules={name: str(path) for name, path in lora_adapters.items()})
    outputs, accepted = {}, 0
    for spec in (None, NGRAM):
        with LLMEngine(EngineConfig(**config, speculative_config=spec), load_tokenizer_files=False) as engine:
            outputs[spec] = [r.token_ids for r in engine.generate(prompts, greedy, lora_names=names)]
            if spec is not None:
                accepted = engine.scheduler.speculator.num_accepted_tokens
    assert accepted > 0
    assert outputs[NGRAM] == outputs[None]


def test_no_speculation_above_disable_by_batch_size(tiny) -> None:
    short = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    spec = _run(tiny, PROMPTS[:3], short, SpeculativeConfig(disable_by_batch_size=2))
    assert spec.drafted == 0


def test_verify_steps_replay_the_mixed_graphs_and_stay_greedy_identical(
        tiny, plain, fake_mixed_graphs, nan_for_uninitialized, monkeypatch) -> None:  # noqa: F811
    """On the runner's graph branches (their static buffers run eagerly here, as CUDA replays
    them), a step with drafts takes a mixed graph, whose rows are the eager step's, and scores
    every draft from them: the same tokens as plain decoding. Uninitialized memory reads as NaN
    here (it once turned a sequence's tokens to 0 after its first, in about one run of ten)."""
    monkeypatch.setattr("workers.runner_build.use_cuda_graphs", lambda config, device: True)
    monkeypatch.setattr("workers.runner_build.DecodeGraphs.capture", lambda self: None)  # run eagerly
    greedy = [p for p in PARAMS[:NUM_COMPARED] if p.logprobs is None]
    prompts = PROMPTS[: len(greedy)]
    config = EngineConfig(model=str(tiny), dtype="float32", device="cpu", block_size=4, num_kv_blocks=256,
                          max_num_seqs=6, max_num_batched_tokens=32, cuda_graph_max_tokens=32,
                          speculative_config=NGRAM)
    verify_replays = []
    with LLMEngine(config, load_tokenizer_files=False) as engine:
        graphs = engine.executor.runner.mixed_graphs
        original = graphs.run
        graphs.run = lambda works, *a, **k: (verify_replays.append(any(w.num_draft_tokens for w in works))
                                             or original(works, *a, **k))
        outputs = [r.token_ids for r in engine.generate(prompts, greedy)]
        accepted = engine.scheduler.speculator.num_accepted_tokens
    assert any(verify_replays) and accepted > 0
    assert outputs == plain.outputs()[: len(greedy)]
