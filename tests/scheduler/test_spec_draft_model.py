"""Speculative decoding with a draft model through the whole in-process engine, on tiny random
checkpoints: a smaller draft sharing the target's vocabulary, and the target as its own draft
(whose drafts the target must accept, which holds only if the draft's KV follows the accepted
tokens exactly). Greedy output identical to decoding without speculation in mixed batches, under
preemption (both caches tiny), with a stop string inside an accepted run; bad configs refused."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from scheduler.engine import LLMEngine
from scheduler.speculative.draft_model import DraftModelProposer, common_prefix_length
from shared.config import EngineConfig
from shared.errors import ModelLoadError
from shared.sampling import SamplingParams
from shared.speculative import SpeculativeConfig
from testkit.checkpoints import make_tiny_checkpoint
from tests.scheduler.test_spec_engine import is_mixed_step

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _draft_config(folder, **fields) -> SpeculativeConfig:
    # min_acceptance_rate and min_speedup 0: a random draft is rarely right, and backing off would
    # end the test.
    return SpeculativeConfig(method="draft_model", model=str(folder), num_speculative_tokens=4,
                             min_acceptance_rate=0.0, min_speedup=0.0, **fields)


def _prompts(seed: int, num: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(10 + 5 * i)] for i in range(num)]


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)  # req_id -> output tokens
    num_preemptions: int = 0
    num_mixed_steps: int = 0  # steps with drafts beside a plain decode
    drafted: int = 0
    accepted: int = 0
    num_catch_up_tokens: int = 0
    max_draft_batch: int = 0  # the most works in one draft step

    def outputs(self) -> list[list[int]]:
        return list(self.tokens.values())


class _MixedSteps:
    def __init__(self, run: Run) -> None:
        self.run = run

    def record_step(self, output, outputs, duration_s, result_wait_s=0.0) -> None:
        self.run.num_mixed_steps += is_mixed_step(output.batch.works)


def _run(folder, prompts, params, spec, **overrides) -> Run:
    config = dict(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=6,
                  max_num_batched_tokens=32, speculative_config=spec)
    config.update(overrides)
    params = params if isinstance(params, list) else [params] * len(prompts)
    run = Run()
    with LLMEngine(EngineConfig(**config), load_tokenizer_files=False) as engine:
        engine.step_observer = _MixedSteps(run)
        speculator = engine.scheduler.speculator
        if speculator is not None:  # a spy on the draft's steps (the runner itself runs them)
            runner, execute = speculator.proposer.runner, speculator.proposer.runner.execute

            def spied(batch):
                run.max_draft_batch = max(run.max_draft_batch, len(batch.works))
                return execute(batch)
            runner.execute = spied
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        requests = [engine.scheduler.get_request(i) for i in ids]
        run.tokens = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                run.tokens[out.req_id] += out.new_token_ids
        run.num_preemptions = sum(r.num_preemptions for r in requests)
        if speculator is not None:
            run.drafted, run.accepted = speculator.num_draft_tokens, speculator.num_accepted_tokens
            run.num_catch_up_tokens = speculator.proposer.num_catch_up_tokens
            assert not speculator.proposer._seqs, "a finished request kept its draft KV"
    return run


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return tiny_checkpoints["llama"]  # 4 layers, hidden 64, vocab 512


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """One layer, hidden 32: a different, smaller model on the same vocabulary."""
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("draft") / "draft", seed=7,
                                num_hidden_layers=1, hidden_size=32, intermediate_size=64)


# Four greedy requests, one greedy with logprobs (it never speculates: a plain decode beside the
# others), one sampled (it speculates; its output is not compared, only its length).
PROMPTS = _prompts(1, 6)
PARAMS = [GREEDY] * 4 + [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0),
                         SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)]
NUM_COMPARED = 5


@pytest.fixture(scope="module")
def plain(target) -> Run:
    return _run(target, PROMPTS, PARAMS, None)


def test_greedy_identical_with_a_smaller_draft_in_a_mixed_batch(target, small_draft, plain) -> None:
    spec = _run(target, PROMPTS, PARAMS, _draft_config(small_draft))
    assert spec.outputs()[:NUM_COMPARED] == plain.outputs()[:NUM_COMPARED]
    assert spec.drafted > 0 and spec.num_mixed_steps > 0
    assert len(spec.outputs()[-1]) == 16


def test_the_target_as_its_own_draft_has_every_greedy_draft_accepted(target, plain) -> None:
    """The draft's KV must hold exactly the accepted tokens at their positions, or the draft
    (the same weights) would guess other tokens than the target."""
    spec = _run(target, PROMPTS[:4], GREEDY, _draft_config(target))
    assert spec.outputs() == plain.outputs()[:4]
    assert spec.drafted > 0 and spec.accepted >= 0.95 * spec.drafted
    assert spec.max_draft_batch > 1, "the speculating requests were never proposed for together"
    # Each verify of K drafts yields K + 1 tokens, and only those (not the prompt again) are caught up.
    num_prompt_tokens = sum(len(p) for p in PROMPTS[:4])
    assert spec.num_catch_up_tokens <= num_prompt_tokens + 2 * sum(len(t) for t in spec.outputs())


def test_greedy_identical_when_a_tiny_cache_preempts_and_the_draft_cache_evicts(target, plain) -> None:
    # 24 blocks of 4 for the target and for the draft: six sequences of up to 51 tokens do not fit.
    spec = _run(target, PROMPTS, PARAMS, _draft_config(target), num_kv_blocks=24)
    assert spec.num_preemptions > 0, "the tiny cache never forced a preemption"
    assert spec.accepted > 0
    assert spec.outputs()[:NUM_COMPARED] == plain.outputs()[:NUM_COMPARED]


def test_a_stop_string_inside_an_accepted_run_ends_the_output_there(tiny_chat) -> None:
    """tiny_chat speaks SmolLM2's tokenizer; as its own draft, verifies yield K + 1 tokens at once,
    so a stop a few tokens in falls inside an accepted run."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    config = dict(model=str(tiny_chat), dtype="float32", block_size=4, num_kv_blocks=256)
    with LLMEngine(EngineConfig(**config)) as engine:
        plain = engine.generate(["The quick brown fox"], params)[0]
        stop = next(engine.tokenizer.decode([t]) for t in plain.token_ids[6:]
                    if len(engine.tokenizer.decode([t]).strip()) >= 2)
        expected = engine.generate(["The quick brown fox"], SamplingParams(
            temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]))[0]
    assert expected.finish_reason.value == "stop" and len(expected.token_ids) < 16
    with LLMEngine(EngineConfig(**config, speculative_config=_draft_config(tiny_chat))) as engine:
        spec = engine.generate(["The quick brown fox"], SamplingParams(
            temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]))[0]
        assert engine.scheduler.speculator.num_accepted_tokens > 0
    assert (spec.token_ids, spec.text, spec.finish_reason) == (
        expected.token_ids, expected.text, expected.finish_reason)


def test_a_missing_draft_folder_is_refused_naming_it(target, tmp_path) -> None:
    missing = tmp_path / "no-such-draft"
    with pytest.raises(ModelLoadError, match="draft model.*no-such-draft"):
        LLMEngine(EngineConfig(model=str(target), speculative_config=_draft_config(missing)),
                  load_tokenizer_files=False)


def test_a_draft_with_another_vocabulary_is_refused_naming_both(target, tmp_path) -> None:
    other = make_tiny_checkpoint("llama", tmp_path / "other-vocab", num_hidden_layers=1, vocab_size=256)
    with pytest.raises(ModelLoadError, match="other-vocab.*vocab_size 256.*llama.*512"):
        LLMEngine(EngineConfig(model=str(target), speculative_config=_draft_config(other)),
                  load_tokenizer_files=False)


def test_a_draft_with_another_tokenizer_is_refused(tiny_chat, tmp_path) -> None:
    import json
    import shutil

    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_chat, other)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match="different tokenizers"):
        LLMEngine(EngineConfig(model=str(tiny_chat), speculative_config=_draft_config(other)))


def test_drafts_depend_on_the_tokens_only_not_on_the_draft_caches_history(target) -> None:
    """What makes the point-mass acceptance rule exact for sampled requests: a draft is a function
    of the request's tokens (greedy), whatever the cache held before (rolled back, caught up)."""
    from workers.model_runner import ModelRunner
    from workers.parallel import SINGLE_DEVICE

    runner = ModelRunner(EngineConfig(model=str(target), dtype="float32", block_size=4, num_kv_blocks=64,
                                      cuda_graphs=False), SINGLE_DEVICE)
    proposer = DraftModelProposer(runner, max_chunk_tokens=8)
    try:
        tokens = _prompts(3, 1)[0]
        fresh = proposer.propose(tokens, 4, req_id="a")
        proposer.propose(tokens[:-3] + [5, 6], 4, req_id="b")  # another history for "b"
        assert proposer.propose(tokens, 4, req_id="b") == fresh
        # Everything after a rejection rolls back: "a" continues as if its drafts were not there.
        assert proposer.propose(tokens + [fresh[0], 9], 3, req_id="a") == proposer.propose(
            tokens + [fresh[0], 9], 3, req_id="c")
        proposer.forget("a")
        proposer.forget("b")
        proposer.forget("c")
        assert proposer.num_free_blocks == 64
    finally:
        proposer.close()
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix_length([], [1]) == 0


@pytest.mark.slow
def test_greedy_identical_with_async_scheduling(target, plain) -> None:
    """Speculating requests wait for their tokens (no step ahead while one would speculate), as
    with n-gram drafts; the draft's cache follows them all the same."""
    spec = _run(target, PROMPTS, PARAMS, _draft_config(target), async_scheduling=True)
    assert spec.accepted > 0
    assert spec.outputs()[:NUM_COMPARED] == plain.outputs()[:NUM_COMPARED]


@pytest.mark.slow
def test_greedy_identical_with_tp2_the_draft_on_the_driver(target, small_draft, plain) -> None:
    """The target's ranks shard (a Ray group of two), the draft runs unsharded in the engine's
    process; the verify is the group's as with n-gram drafts."""
    spec = _run(target, PROMPTS, PARAMS, _draft_config(small_draft), tp=2)
    assert spec.drafted > 0
    assert spec.outputs()[:NUM_COMPARED] == plain.outputs()[:NUM_COMPARED]
