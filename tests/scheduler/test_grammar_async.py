"""Grammars inside async scheduling: a constrained request is planned ahead like any other. Its
step ahead launches the forward only; once the step in flight is taken back and its tokens
accepted by the matchers, the mask is filled and the step sampled (`StepBatch.samples_late`).
The outputs are those of async scheduling off; two steps stay in flight while it runs; where
the executor cannot sample late (a Ray group) or with jump-forward, it waits for its token."""

from __future__ import annotations

import json
import re

import pytest

from scheduler.engine import GenerationResult, LLMEngine, collect_output
from scheduler.grammar import Grammars
from scheduler.request import Request
from scheduler.scheduler import Scheduler, SchedulerConfig
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from tests.scheduler.spies import spy
from tests.scheduler.test_grammar import PET_GRAMMAR, PROMPTS, Pet

ANY_JSON = json.dumps({"type": "json_object"})


def _scheduler(smollm2, *, samples_late: bool, jump_forward: bool = False) -> Scheduler:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    config = SchedulerConfig(max_model_len=1024, num_kv_blocks=100, block_size=4, max_num_seqs=8,
                             max_num_batched_tokens=64, async_scheduling=True, samples_late=samples_late)
    return Scheduler(config, tokenizer, Grammars(tokenizer, 49152, [2], jump_forward=jump_forward))


def _add(scheduler: Scheduler, req_id: str, grammar: str | None) -> None:
    scheduler.add_request(Request(req_id, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8,
                                                                     grammar=grammar)))


def test_a_constrained_request_goes_ahead_in_a_step_that_samples_late(smollm2) -> None:
    scheduler = _scheduler(smollm2, samples_late=True)
    _add(scheduler, "json", ANY_JSON)
    _add(scheduler, "free", None)
    first = scheduler.schedule()
    assert not first.batch.samples_late  # its prompt's tokens are known: its mask can be filled now
    assert not scheduler.has_requests_needing_their_token()
    ahead = scheduler.schedule()
    assert [(w.req_id, w.is_token_pending) for w in ahead.batch.works] == [("json", True), ("free", True)]
    assert ahead.batch.samples_late and ahead.batch.mask_filler is not None


def test_a_free_step_ahead_does_not_sample_late(smollm2) -> None:
    scheduler = _scheduler(smollm2, samples_late=True)
    _add(scheduler, "free", None)
    scheduler.schedule()
    ahead = scheduler.schedule()
    assert ahead.batch.works[0].is_token_pending and not ahead.batch.samples_late


@pytest.mark.parametrize("samples_late, jump_forward", [(False, False), (True, True)],
                         ids=["executor_cannot", "jump_forward"])
def test_a_constrained_request_waits_for_its_token_where_the_step_cannot_sample_late(
        smollm2, samples_late, jump_forward) -> None:
    scheduler = _scheduler(smollm2, samples_late=samples_late, jump_forward=jump_forward)
    _add(scheduler, "json", ANY_JSON)
    _add(scheduler, "free", None)
    scheduler.schedule()
    assert scheduler.has_requests_needing_their_token()
    ahead = scheduler.schedule()
    assert [w.req_id for w in ahead.batch.works] == ["free"] and not ahead.batch.samples_late


def test_a_terminated_matchers_row_is_left_unmasked(smollm2) -> None:
    """The step after the one that ended a grammar still has the request's row (dropped later):
    the fill leaves it all-allowed, and fills the other rows as usual."""
    from transformers import AutoTokenizer

    from shared.step import SequenceWork

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    grammars = Grammars(tokenizer, 49152, [2])
    grammars.add("done", ANY_JSON, tokenizer("{}", add_special_tokens=False).input_ids + [2])
    grammars.add("open", ANY_JSON, tokenizer('{"a": ', add_special_tokens=False).input_ids)
    grammars.add("open2", ANY_JSON, tokenizer('{"b', add_special_tokens=False).input_ids)
    works = [SequenceWork(r, [1], 9, [0], True, SamplingParams()) for r in ("done", "open", "open2")]
    mask = grammars.fill(works)
    assert mask.rows == [0, 1, 2]
    assert (mask.bits[0] == -1).all()  # all allowed
    assert not (mask.bits[1] == -1).all() and not (mask.bits[2] == -1).all()
    alone = Grammars(tokenizer, 49152, [2])
    alone.add("open", ANY_JSON, tokenizer('{"a": ', add_special_tokens=False).input_ids)
    assert (alone.fill(works[1:2]).bits[0] == mask.bits[1]).all()


def test_the_mask_of_a_step_ahead_is_filled_after_the_step_in_flights_tokens_are_accepted(tiny_chat):
    """Forward of step n+1, then step n's token accepted, then step n+1's mask and sampling:
    F f s, then F a f s for every step after the first."""
    config = EngineConfig(model=str(tiny_chat), dtype="float32", num_kv_blocks=64, max_num_seqs=8,
                          async_scheduling=True)
    with LLMEngine(config) as engine:
        runner, grammars = engine.executor.runner, engine.scheduler.grammars
        events: list[str] = []

        runner._forward = spy(events, "F", runner._forward)  # (what launch calls)
        runner.sampler.sample_on_device = spy(events, "s", runner.sampler.sample_on_device)
        grammars._fill = spy(events, "f", grammars._fill)
        grammars.accept = spy(events, "a", grammars.accept)
        [constrained] = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=40, temperature=0.0,
                                                                    grammar=PET_GRAMMAR), chat=True)
    steps = "".join(events)
    assert re.fullmatch("Ffs(Fafs)+", steps), steps
    assert steps.count("a") == len(constrained.token_ids)  # the last step ahead is dropped
    assert constrained.finish_reason.value == "stop"  # the grammar ended it
    Pet.model_validate_json(constrained.text)


def _run(folder, prompts, params, *, async_scheduling: bool, watch: int | None = None
         ) -> tuple[list[GenerationResult], list[int]]:
    """The engine's results, and (for request `watch`) the steps in flight before each collect
    while it ran."""
    config = EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=128, max_num_seqs=8,
                          max_num_batched_tokens=64, async_scheduling=async_scheduling)
    depths = []
    with LLMEngine(config) as engine:
        results = {}
        for prompt, sp in zip(prompts, params, strict=True):
            ids = engine.encode(prompt, chat=True)
            req_id = engine.add_request(ids, sp)
            results[req_id] = GenerationResult(req_id, ids)
        watched = list(results)[watch] if watch is not None else None
        while engine.has_unfinished_requests():
            running = watched is not None and results[watched].finish_reason is None
            outputs = engine.step()
            if running:
                depths.append(engine.num_in_flight + 1)  # this call collected one
            for out in outputs:
                collect_output(results[out.req_id], out)
    return list(results.values()), depths


@pytest.mark.slow
def test_smollm2_json_schema_and_mixed_batches_match_async_off_with_two_steps_in_flight(smollm2):
    """SmolLM2, greedy: JSON-schema requests beside plain and penalized ones give the tokens of
    async scheduling off, and while the first JSON request runs two steps stay in flight."""
    prompts = ["Describe a pet as JSON.", "Write one sentence about the sea.", "List three colours.",
               "Give me a pet in JSON.", "Say hello."]
    params = [SamplingParams(temperature=0.0, max_tokens=48, grammar=PET_GRAMMAR),
              SamplingParams(temperature=0.0, max_tokens=24),
              SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.4),
              SamplingParams(temperature=0.0, max_tokens=48, grammar=ANY_JSON, presence_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    off, _ = _run(smollm2, prompts, params, async_scheduling=False)
    on, depths = _run(smollm2, prompts, params, async_scheduling=True, watch=0)
    for got, want in zip(on, off, strict=True):
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    Pet.model_validate_json(on[0].text)
    if on[3].finish_reason.value == "stop":
        json.loads(on[3].text)
    assert on[0].finish_reason.value == "stop"
    # While the constrained request ran, every collect had the step ahead in flight beside it.
    assert len(depths) > 10 and set(depths) == {2}, depths


def test_the_step_trace_says_which_steps_had_constrained_rows_sampled_late_and_what_they_cost(
        tiny_chat, tmp_path, monkeypatch) -> None:
    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv("TOKENFLEET_STEP_TRACE", str(trace))
    config = EngineConfig(model=str(tiny_chat), dtype="float32", num_kv_blocks=64, max_num_seqs=8,
                          async_scheduling=True)
    with LLMEngine(config) as engine:
        engine.generate(PROMPTS[:2], [SamplingParams(max_tokens=12, temperature=0.0, grammar=PET_GRAMMAR),
                                      SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)],
                        chat=True)
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    constrained = [s for s in steps if s["constrained_rows"]]
    assert constrained and all(s["constrained_rows"] == 1 and s["fill_ms"] > 0 for s in constrained)
    late = [s for s in constrained if s["samples_late"]]
    assert late and all(s["late_wait_ms"] > 0 for s in late)
    # Once the constrained request is gone, its steps neither sample late nor fill a mask.
    after = steps[steps.index(constrained[-1]) + 2:]
    assert after and not any(s["samples_late"] or s["fill_ms"] or s["constrained_rows"] for s in after)


def test_a_late_step_is_sampled_once_the_constrained_rows_are_taken_before_the_other_rows(tiny_chat):
    """Step n taken back: the constrained row's token accepted, step n+1's mask filled and its
    sampling launched, and only then the free row's token appended (its stop checks, its output):
    the device's wait for the step ahead's sampling is the constrained rows' host work alone."""
    config = EngineConfig(model=str(tiny_chat), dtype="float32", num_kv_blocks=64, max_num_seqs=8,
                          async_scheduling=True)
    with LLMEngine(config) as engine:
        runner, scheduler = engine.executor.runner, engine.scheduler
        events: list[str] = []
        runner.sampler.sample_on_device = spy(events, "s", runner.sampler.sample_on_device)
        append = scheduler._append_token

        def appended(request, *args):
            events.append("a" if request.sampling.grammar is not None else "p")  # a row's token taken
            return append(request, *args)

        scheduler._append_token = appended
        params = [SamplingParams(max_tokens=6, temperature=0.0, grammar=PET_GRAMMAR),
                  SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
        results = engine.generate(PROMPTS[:2], params, chat=True)
    steps = "".join(events)
    # Once both decode: each step taken back takes the constrained row, samples the step ahead,
    # then takes the free row.
    assert re.search("(asp){3}", steps), steps  # (taken in batch order, it would be "aps")
    assert len(results[1].token_ids) == 6
