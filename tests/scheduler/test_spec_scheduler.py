"""Speculative decoding in the scheduler core, driven by a fake runner that verifies drafts
against a fake paged KV cache: outputs equal plain decoding's (a stale or misplaced slot would
change them), stops and max_tokens cut an accepted run, rejected drafts' blocks go back and
never reach the prefix cache, preemption stays exact."""

from __future__ import annotations

import pytest

from scheduler.block_manager import cdiv
from scheduler.request import BATCH_PRIORITY, Request
from scheduler.scheduler import Scheduler, SchedulerConfig
from shared.sampling import SamplingParams
from shared.speculative import SpeculativeConfig
from shared.step import SampledToken, StepBatch, StepResult
from tests.scheduler.test_scheduler import VOCAB, CharTokenizer, FakeRunner, make_request, run_all, step

NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=2,
                          disable_by_batch_size=64)


def copy_back_4(history: list[int]) -> int:
    """Repeats the token four back, except where the history's weighted sum says otherwise:
    drafts copied from earlier tokens are often, not always, right, and every position counts."""
    weighted = sum((i + 1) * t for i, t in enumerate(history))
    return history[-4] if weighted % 7 else (history[-1] + 3) % VOCAB


class VerifyingRunner(FakeRunner):
    """A decode with drafts: every token written to the fake cache, then each draft checked
    against the token the history up to it gives, as the model runner's greedy rule does."""

    def __call__(self, batch: StepBatch) -> StepResult:
        plain = StepBatch(batch.step_id, [w for w in batch.works if not w.num_draft_tokens])
        result = super().__call__(plain)
        verified = {}
        for work in batch.works:
            if not work.num_draft_tokens:
                continue
            for pos, token in enumerate(work.token_ids, start=work.start_pos):
                self.slots[self._slot(work.block_ids, pos)] = (work.req_id, pos, token)
            drafts = work.token_ids[-work.num_draft_tokens:]
            num_known = work.start_pos + len(work.token_ids) - len(drafts)
            for i in range(len(drafts) + 1):
                history = [self._read(work.req_id, work.block_ids, p) for p in range(num_known + i)]
                token = self.next_token(history)
                if i == len(drafts) or token != drafts[i]:
                    verified[work.req_id] = SampledToken(work.req_id, token, num_accepted_drafts=i)
                    break
        tokens = iter(result.sampled)
        sampled = [verified[w.req_id] if w.num_draft_tokens else next(tokens)
                   for w in batch.works if w.is_sampled]
        return StepResult(batch.step_id, sampled)


def _scheduler(spec: SpeculativeConfig | None, tokenizer=None, **overrides) -> Scheduler:
    config = dict(max_model_len=1024, num_kv_blocks=1000, block_size=4, max_num_seqs=8,
                  max_num_batched_tokens=64, speculative=spec)
    config.update(overrides)
    return Scheduler(SchedulerConfig(**config), tokenizer)


def _run(spec, requests, tokenizer=None, **overrides):
    scheduler = _scheduler(spec, tokenizer, **overrides)
    runner = VerifyingRunner(scheduler.config.block_size, copy_back_4)
    for request in requests:
        scheduler.add_request(request)
    collected, outs = {}, []
    while scheduler.has_unfinished_requests():
        outs.append(step(scheduler, runner, collected))
        for request in requests:  # rejected drafts' blocks went back at once
            if request.status.value == "running" and not request.num_in_flight_tokens:
                assert len(request.block_ids) <= cdiv(request.num_tokens, scheduler.config.block_size)
        assert len(outs) < 5000
    assert scheduler.block_manager.num_free_blocks == scheduler.config.num_kv_blocks
    return collected, outs, scheduler


def _requests(**sampling):
    sampling.setdefault("max_tokens", 40)
    return [make_request(f"r{i}", num_prompt=5 + i, first_token=17 * i, **sampling) for i in range(6)]


def test_plain_fake_runner_matches_the_verifying_one_without_drafts():
    plain, _ = run_all(_scheduler(None), _requests(), copy_back_4)
    same, _, _ = _run(None, _requests())
    assert plain == same


def test_outputs_equal_plain_decoding_with_drafts_accepted_and_rejected():
    plain, _, _ = _run(None, _requests())
    spec, outs, scheduler = _run(NGRAM, _requests())
    assert spec == plain
    speculator = scheduler.speculator
    assert 0 < speculator.num_accepted_tokens < speculator.num_draft_tokens
    assert speculator.num_emitted_tokens == speculator.num_accepted_tokens + speculator.num_drafts
    # The drafts count in the step's tokens, within the budget (checked by `step`).
    assert any(w.num_draft_tokens and len(w.token_ids) == 1 + w.num_draft_tokens
               for out in outs for w in out.batch.works)


def test_a_request_that_cannot_speculate_runs_plainly_beside_speculating_ones():
    requests = _requests()
    requests[0].sampling.logprobs = 0
    plain, _, _ = _run(None, _requests())
    spec, outs, _ = _run(NGRAM, requests)
    assert spec == plain
    assert not any(w.num_draft_tokens for out in outs for w in out.batch.works if w.req_id == "r0")
    assert any(any(w.num_draft_tokens for w in out.batch.works) and any(
        w.req_id == "r0" and len(w.token_ids) == 1 for w in out.batch.works) for out in outs)


def test_preemption_by_a_tiny_cache_stays_exact():
    plain, _, _ = _run(None, _requests())
    requests = _requests()
    spec, _, scheduler = _run(NGRAM, requests, num_kv_blocks=40)
    assert sum(r.num_preemptions for r in requests) > 0
    assert scheduler.speculator.num_accepted_tokens > 0
    assert spec == plain


def test_prefix_cache_never_holds_a_rejected_draft():
    """A request that arrives after another finished starts from its cached blocks; the fake
    runner checks that every shared slot it reads holds the reader's own token."""
    first, second = (make_request(r, num_prompt=9, first_token=40, max_tokens=30) for r in ("a", "b"))
    scheduler = _scheduler(NGRAM)
    runner = VerifyingRunner(4, copy_back_4)
    collected = {}
    scheduler.add_request(first)
    while scheduler.has_unfinished_requests():
        step(scheduler, runner, collected)
    assert scheduler.speculator.num_draft_tokens > scheduler.speculator.num_accepted_tokens > 0
    second.prompt_token_ids = first.prompt_token_ids + collected["a"].token_ids[:20]
    scheduler.add_request(second)
    while scheduler.has_unfinished_requests():
        step(scheduler, runner, collected)
    assert second.num_cached_tokens >= 24 and runner.num_shared_reads > 0
    assert collected["b"].token_ids == _plain_continuation(second.prompt_token_ids, 30)


def _plain_continuation(history: list[int], num: int) -> list[int]:
    history = list(history)
    for _ in range(num):
        history.append(copy_back_4(history))
    return history[-num:]


def test_stop_token_inside_an_accepted_run_ends_the_output_there():
    # Prompt 5 6 7 8 5 6 7 8: every draft is right; the stop token 7 is the second draft of the
    # first decode, and nothing after it comes out.
    def copy4(history):
        return history[-4]

    prompt = [5, 6, 7, 8, 5, 6, 7, 8]
    for stop in ({"stop_token_ids": [7]}, {"stop": ["h"]}):  # CharTokenizer: token 7 is "h"
        scheduler = _scheduler(NGRAM, CharTokenizer())
        runner = VerifyingRunner(4, copy4)
        request = Request("s", prompt, SamplingParams(temperature=0.0, max_tokens=40, **stop))
        scheduler.add_request(request)
        collected = {}
        outs = []
        while scheduler.has_unfinished_requests():
            outs.append(step(scheduler, runner, collected))
        assert collected["s"].token_ids == [5, 6, 7]
        assert any(w.num_draft_tokens >= 2 for out in outs for w in out.batch.works)
        assert collected["s"].finish_reason.value == "stop"
        assert collected["s"].text == "fg"  # neither a stop token nor a stop string adds text


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 6])
def test_max_tokens_holds_where_drafts_would_run_past_it(max_tokens):
    spec, outs, _ = _run(NGRAM, _requests(max_tokens=max_tokens))
    assert all(len(c.token_ids) == max_tokens for c in spec.values())
    plain, _, _ = _run(None, _requests(max_tokens=max_tokens))
    assert spec == plain


def test_drafts_never_take_a_preemption():
    """Where the cache cannot hold the drafts, the decode runs plainly instead."""
    requests = [make_request("x", num_prompt=7, first_token=3, max_tokens=30)]
    spec, outs, _ = _run(NGRAM, requests, num_kv_blocks=10)  # 40 slots: the drafts fit until near the end
    assert requests[0].num_preemptions == 0
    plain, _, _ = _run(None, [make_request("x", num_prompt=7, first_token=3, max_tokens=30)],
                       num_kv_blocks=10)
    assert spec == plain


def test_async_engine_waits_for_a_request_that_would_speculate_and_not_for_one_backed_off():
    """has_requests_needing_their_token: True while a running request would propose (its drafts
    come from its tokens on the host), False once it backed off or the batch is past
    disable_by_batch_size, and never for a request that cannot speculate. (Look-ups of one token:
    then any look-up may find drafts; where none can, tests/scheduler/test_spec_gain.py.)"""
    config = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=1, backoff_steps=100,
                               prompt_lookup_min=1)
    scheduler = _scheduler(config, async_scheduling=True)
    plain = make_request("plain", num_prompt=6, logprobs=0, max_tokens=40)
    scheduler.add_request(plain)
    collected = {}
    runner = VerifyingRunner(4, copy_back_4)
    step(scheduler, runner, collected)
    assert not scheduler.has_requests_needing_their_token()  # it asks for logprobs
    speculating = make_request("spec", num_prompt=6, max_tokens=40)
    scheduler.add_request(speculating)
    step(scheduler, runner, collected)
    assert not scheduler.has_requests_needing_their_token()  # two running > disable_by_batch_size
    scheduler.abort_request("plain")
    step(scheduler, runner, collected)
    assert scheduler.has_requests_needing_their_token()
    for _ in range(8):  # nothing accepted: it backs off
        scheduler.speculator.record(speculating, 4, 0)
    assert not scheduler.has_requests_needing_their_token()


def test_a_batch_decode_beside_a_chat_still_drafts_within_the_time_cap():
    """A less important decode asks the step's cap for room for its drafts, not for its one token
    (which would leave none): beside a chat, a copy-heavy batch item keeps speculating."""
    scheduler = _scheduler(NGRAM)
    runner = VerifyingRunner(next_token=copy_back_4)
    scheduler.add_request(make_request("b", num_prompt=16, first_token=1, priority=BATCH_PRIORITY,
                                       max_tokens=60))
    scheduler.add_request(make_request("chat", num_prompt=8, first_token=50, priority=0, max_tokens=60))
    drafted = 0
    for _ in range(20):
        out = step(scheduler, runner, {})
        drafted += sum(w.num_draft_tokens for w in out.batch.works if w.req_id == "b")
    assert drafted > 0
