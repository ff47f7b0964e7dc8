"""The expected-gain rule (scheduler/speculative/gain.py) and how a request goes off and back on
speculation by it (scheduler/speculative/speculator.py): n-gram requests by look-ups replayed on
the host, a draft model's after a back-off that doubles. Real models through the engine:
tests/scheduler/test_spec_chat_gain.py."""

from __future__ import annotations

import pytest

from scheduler.request import Request
from scheduler.speculative.gain import HOST_MS, HOST_SHARE, ROW_COST, SYNC_STEP, predicted_speedup
from scheduler.speculative.speculator import Speculator
from scheduler.step_cost import StepCost
from shared.sampling import SamplingParams
from shared.speculative import SpeculativeConfig

COPY = [(4, 4)] * 7 + [(4, 3)]  # a copy: nearly every draft accepted
CHAT = [(4, 1), (0, 0), (4, 2), (3, 0), (0, 0), (4, 1), (4, 0), (2, 0)]  # an open chat


def test_without_timed_steps_the_rule_prices_steps_as_the_h100_run_did() -> None:
    # a copy's look-up: 5 tokens for SYNC_STEP + 4 * ROW_COST + HOST_SHARE plain steps
    assert predicted_speedup([(4, 4)], 1, None, True) == pytest.approx(
        5 / (SYNC_STEP + 4 * ROW_COST + HOST_SHARE))
    assert predicted_speedup(COPY, 1, None, True) > 1.8  # (the run measured 1.88x at 4.61 per verify)
    assert predicted_speedup([(4, 1.43)], 1, None, True) < 1  # the run's chat verifies: 0.89x
    assert predicted_speedup(CHAT, 1, None, True) < 0.8
    # Nothing found: a step without the async scheduling it gave up; nothing lost without it.
    assert predicted_speedup([(0, 0)] * 8, 1, None, True) == pytest.approx(1 / (SYNC_STEP + HOST_SHARE))
    assert predicted_speedup([(0, 0)] * 8, 1, None, False) == pytest.approx(1.0)
    assert predicted_speedup([(4, 4)], 1, None, False) == pytest.approx(5 / (1 + 4 * ROW_COST))
    assert predicted_speedup([], 1, None, True) == 1.0


def test_the_rule_prices_look_ups_with_the_step_cost_model() -> None:
    cost = StepCost()
    for tokens, ms in ((1, 1.0), (4, 1.5), (8, 2.0), (16, 3.0)):
        cost.observe(tokens, ms)
    # batch 1, one look-up of 4 drafts, 2 accepted: 3 tokens in a 5-token step (1.625 ms) + h
    assert predicted_speedup([(4, 2)], 1, cost.predict, True) == pytest.approx(3 / (1.625 + HOST_MS))
    # batch 8: the same look-up adds 2 tokens to 8, in a 12-token step (2.5 ms) instead of 2 ms
    assert predicted_speedup([(4, 2)], 8, cost.predict, False) == pytest.approx((10 / 2.5) / (8 / 2.0))
    # the same acceptance pays less in a larger batch
    assert predicted_speedup(COPY, 8, cost.predict, True) < predicted_speedup(COPY, 1, cost.predict, True)


def _request(prompt: list[int]) -> Request:
    return Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=500))


def _decode(speculator: Speculator, request: Request, next_token) -> None:
    """One step of the request: a verify of its drafts when it speculates (accepted as far as
    they match what `next_token` continues with, as greedy verification does), else one token."""
    assert speculator.step_allows(1)
    drafts = speculator.propose(request, 4)
    truth: list[int] = []
    for _ in range(len(drafts) + 1):
        truth.append(next_token(request.all_token_ids + truth))
    accepted = next((i for i, d in enumerate(drafts) if d != truth[i]), len(drafts))
    if drafts:
        speculator.record(request, len(drafts), accepted)  # (before the tokens, as finishing.py does)
    request.output_token_ids += truth[:accepted + 1]


PHRASE = list(range(100, 112))


def copying(tokens: list[int]) -> int:
    """Repeats a 12-token phrase."""
    return PHRASE[(len(tokens) - 1) % len(PHRASE)]


def counting(tokens: list[int]) -> int:
    """Never repeats an earlier pair: no look-up finds anything... until it copies (past 200)."""
    return copying(tokens) if len(tokens) > 200 else 1000 + len(tokens)


def test_an_ngram_request_goes_off_where_look_ups_do_not_pay_and_back_on_where_they_would() -> None:
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4), gives_up_async=True)
    request = _request([5, 6, 7, 5, 6])
    while request.num_tokens < 120:
        _decode(speculator, request, counting)
    assert speculator.num_backoffs == 1 and not speculator.wants_to_speculate(request)
    assert speculator.num_drafts <= 8  # its first window, then shadow look-ups only
    while request.num_tokens < 200:
        _decode(speculator, request, counting)
    assert not speculator.wants_to_speculate(request)  # its shadow look-ups still find nothing
    drafts_before = speculator.num_drafts
    while request.num_tokens < 260:  # now it copies: the look-ups it would make pay again
        _decode(speculator, request, counting)
    assert speculator.num_resumes == 1 and speculator.wants_to_speculate(request)
    assert speculator.num_drafts > drafts_before and speculator.num_backoffs == 1


def test_a_copying_request_keeps_speculating() -> None:
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4), gives_up_async=True)
    request = _request(PHRASE * 2)
    while request.num_tokens < 200:
        _decode(speculator, request, copying)
    assert speculator.num_backoffs == 0 and speculator.acceptance_rate > 0.9


class FixedDrafts:
    """A proposer that no host replay can score (like a draft model): always the same drafts."""

    def propose(self, token_ids, max_drafts: int, req_id: str = "") -> list[int]:
        return [1, 2, 3, 4][:max_drafts]

    def forget(self, req_id: str) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_draft_model_request_probes_again_after_a_back_off_that_doubles() -> None:
    config = SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=4, backoff_steps=10)
    speculator = Speculator(config, FixedDrafts(), gives_up_async=True)
    request = _request([5, 6, 7])
    resumed_after = []
    for _ in range(3):
        for _ in range(3):  # look-ups accepting nothing: three, and its best (nothing) would not pay
            assert speculator.wants_to_speculate(request)
            speculator.record(request, 4, 0)
            request.output_token_ids.append(9)
        assert not speculator.wants_to_speculate(request)
        waited = 0
        while not speculator.wants_to_speculate(request):
            request.output_token_ids.append(9)
            waited += 1
        resumed_after.append(waited)
    assert resumed_after == [10, 20, 40] and speculator.num_backoffs == 3
    for _ in range(8):  # a window that paid
        assert speculator.wants_to_speculate(request)
        speculator.record(request, 4, 4)
        request.output_token_ids += [9] * 5
    while speculator.wants_to_speculate(request):  # then drafts rejected until it backs off: 10 again
        speculator.record(request, 4, 0)
        request.output_token_ids.append(9)
    waited = 0
    while not speculator.wants_to_speculate(request):
        request.output_token_ids.append(9)
        waited += 1
    assert waited == 10 and speculator.num_backoffs == 4


def test_acceptance_above_the_floor_still_backs_off_where_the_verify_steps_cost_more() -> None:
    """One draft of four accepted (25%, above min_acceptance_rate 0.2): two tokens for a verify
    step priced 1.72 plain steps (2.53 with the async scheduling given up): under min_speedup."""
    request = _request([5, 6, 7])
    for gives_up_async in (True, False):
        speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4), gives_up_async=gives_up_async)
        for _ in range(8):
            speculator.record(request, 4, 1)
        assert speculator.num_backoffs == 1
    lenient = Speculator(SpeculativeConfig(num_speculative_tokens=4, min_speedup=1.1))
    for _ in range(8):
        lenient.record(request, 4, 1)  # 2 / 1.72 = 1.16 without async scheduling to lose
    assert lenient.num_backoffs == 0 and lenient.wants_to_speculate(request)


def test_the_speculator_prices_with_the_cost_model_once_it_has_two_points() -> None:
    cost = StepCost()
    speculator = Speculator(SpeculativeConfig(), step_cost=lambda: cost, gives_up_async=True)
    assert speculator.step_allows(1)
    prior = predicted_speedup([(4, 2)], 1, None, True)
    cost.observe(1, 1.0)  # one point: it would price a 5-token step at 5 ms
    assert speculator.predicted_speedup([(4, 2)]) == pytest.approx(prior)
    cost.observe(16, 1.5)
    assert speculator.predicted_speedup([(4, 2)]) == pytest.approx(
        3 / (cost.predict(5) + HOST_MS))


def test_a_request_whose_look_up_cannot_find_drafts_holds_no_step_back() -> None:
    """Two-token suffixes at least: with its next token pending, a request whose last known
    token never occurred before cannot find drafts at its next look-up, so it may be scheduled
    ahead; with its tokens on the host, the look-up itself says (and counts, found or not)."""
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2))
    request = _request([5, 6, 7, 8])
    request.output_token_ids = [9]
    request.num_computed_tokens = 4
    request.num_pending_tokens = 1  # a token on its way: the suffix would be [9, pending]
    assert not speculator.wants_to_speculate(request) and speculator.num_lookups == 0
    request.num_pending_tokens, request.num_computed_tokens = 0, 5
    request.output_token_ids = [9, 6]  # on the host now, and [9, 6] never occurred: nothing found
    assert not speculator.wants_to_speculate(request)
    assert speculator.num_lookups == 1 and speculator.propose(request, 4) == []
    request.output_token_ids = [9, 6, 7]  # [6, 7] occurred: the look-up finds [8, 9, 6, 7]
    request.num_computed_tokens = 6
    assert speculator.wants_to_speculate(request)
    assert speculator.propose(request, 3) == [8, 9, 6] and speculator.num_lookups == 2
    request.output_token_ids = [9, 6, 7, 8]
    request.num_computed_tokens, request.num_pending_tokens = 6, 1  # 8 occurred before: it may find
    assert speculator.wants_to_speculate(request)
    one_token = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    request.output_token_ids = [9]
    assert one_token.wants_to_speculate(request)  # any pending token may have occurred before


def test_the_speculator_prices_a_step_with_the_context_its_rows_read() -> None:
    """Where the steps' time is mostly their rows' context, the plain step is priced with that
    context (what it took), not at the curve's no-context time, which would make the host's
    0.5 ms look large beside it and turn speculation off where it pays."""
    cost = StepCost()
    speculator = Speculator(SpeculativeConfig(disable_by_batch_size=256), step_cost=lambda: cost,
                            gives_up_async=True)
    assert speculator.step_allows(64)
    for step in range(40):  # 64 decodes of about 4k context (~2 ms); a few prefill steps
        context = 64 * (4000 + 50 * (step % 7))
        cost.observe(64, 0.5 + 4e-6 * context, kv_tokens=context)
        cost.observe(2048, 20.0 + 4e-6 * 2048, kv_tokens=2048)
    assert cost.ms_per_kv_token == pytest.approx(4e-6, rel=0.05)
    step_ms = speculator._step_ms()
    assert step_ms(64) == pytest.approx(0.5 + 4e-6 * 64 * 4150, rel=0.05)
    assert step_ms(64) > 1.5 * cost.predict(64)  # what the curve alone says
