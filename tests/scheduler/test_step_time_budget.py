"""The step budget is time: the cost model predicts a step from its tokens and the context its rows
read; beside a chat, batch decodes are chosen before batch prefill, a prefill chunk is cut to the
time left, the step is predicted within its budget, and the feedback loop still shrinks the budget
when steps run over."""

from __future__ import annotations

import pytest

from scheduler.request import BATCH_PRIORITY
from scheduler.step_budget import SHRINK, LatencyBudget
from scheduler.step_cost import StepCost
from tests.scheduler.test_scheduler import FakeRunner, make_request, make_scheduler, step

MS_PER_TOKEN, MS_PER_KV_TOKEN, FIXED_MS = 0.1, 0.01, 1.0


def true_ms(num_tokens: int, kv_tokens: int) -> float:
    return FIXED_MS + MS_PER_TOKEN * num_tokens + MS_PER_KV_TOKEN * kv_tokens


def kv_cost() -> StepCost:
    """A cost model that has seen steps of every size reading more or less context."""
    cost = StepCost()
    for num_tokens in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        for kv_tokens in (num_tokens, 300, 3000, 800, num_tokens + 50):
            cost.observe(num_tokens, true_ms(num_tokens, kv_tokens), kv_tokens)
    return cost


def test_the_cost_model_learns_what_a_context_token_adds() -> None:
    cost = kv_cost()
    assert cost.ms_per_kv_token == pytest.approx(MS_PER_KV_TOKEN)
    assert cost.predict(100, 5000) == pytest.approx(true_ms(100, 5000))
    assert cost.predict(1, 20_000) == pytest.approx(true_ms(1, 20_000))  # a decode of a long context
    assert cost.max_tokens_within(true_ms(90, 2000) + 1e-9, 4096, kv_tokens=2000) == 90
    # A chunk from position 1000 reads its prefix and itself: 0.11 ms a token past the prefix's 10 ms.
    assert cost.max_chunk_within(20.0, 10, 100, 1000, 4096) == int((20.0 - true_ms(10, 1100)) / 0.11)
    # Where the context never varied within a bucket, tokens alone: the slope is not guessed.
    plain = StepCost()
    for num_tokens in (1, 16, 256):
        for _ in range(3):
            plain.observe(num_tokens, true_ms(num_tokens, 0), 500)
    assert plain.ms_per_kv_token == 0.0 and plain.predict(16, 10**6) == pytest.approx(true_ms(16, 0))


def chat_beside_running_batch(**overrides):
    """Six batch items decoding and one long batch prompt part-prefilled, another waiting; then a
    chat of 20 tokens arrives. The scheduler, its runner, and the step with the chat."""
    overrides.setdefault("max_num_batched_tokens", 256)
    scheduler = make_scheduler(max_model_len=4096, max_num_seqs=32, **overrides)
    scheduler.latency_budget.cost = kv_cost()
    runner = FakeRunner()
    for i in range(6):
        scheduler.add_request(make_request(f"d{i}", num_prompt=40, first_token=i, priority=BATCH_PRIORITY,
                                           arrival_time=float(i), max_tokens=50))
    scheduler.add_request(make_request("long", num_prompt=2000, first_token=99, priority=BATCH_PRIORITY,
                                       arrival_time=10.0, max_tokens=4))
    step(scheduler, runner, {})
    step(scheduler, runner, {})  # every d decoding; "long" part-prefilled
    assert 0 < scheduler.get_request("long").num_computed_tokens < 2000
    scheduler.add_request(make_request("late", num_prompt=300, first_token=7, priority=BATCH_PRIORITY,
                                       arrival_time=11.0))
    scheduler.add_request(make_request("chat", num_prompt=20, first_token=500, arrival_time=12.0))
    return scheduler, runner, step(scheduler, runner, {})


def batch_rows(out) -> tuple[list[str], dict[str, int]]:
    """The step's batch decodes, and its batch prefill chunks (req_id -> tokens)."""
    decodes = [r.req_id for r, _ in out.scheduled_requests
               if r.priority >= BATCH_PRIORITY and out.num_scheduled_tokens[r.req_id] == 1]
    prefill = {r.req_id: out.num_scheduled_tokens[r.req_id] for r, _ in out.scheduled_requests
               if r.priority >= BATCH_PRIORITY and out.num_scheduled_tokens[r.req_id] > 1}
    return decodes, prefill


def test_batch_decodes_go_before_batch_prefill_within_the_time() -> None:
    # 5 ms: the chat's 20 tokens take 3.2; each batch decode adds 0.1 ms and its ~45 context
    # tokens' 0.45: three fit, and no prefill. (By tokens, 38 would have fitted: 18 of batch work.)
    _, _, out = chat_beside_running_batch(itl_target_ms=5.0)
    decodes, prefill = batch_rows(out)
    assert out.num_scheduled_tokens["chat"] == 20
    assert len(decodes) == 3 and prefill == {} and out.was_capped
    assert out.step_token_cap == 38 and out.batch.num_tokens == 23
    assert out.predicted_ms <= 5.0 < true_ms(out.batch.num_tokens + 1, out.num_kv_tokens + 46)


def test_a_prefill_chunk_is_cut_to_the_time_left_and_the_step_is_predicted_within_its_budget() -> None:
    scheduler, _, out = chat_beside_running_batch(itl_target_ms=10.0)
    decodes, prefill = batch_rows(out)
    assert len(decodes) == 6  # every running decode first
    assert list(prefill) == ["long"] and "late" not in out.num_scheduled_tokens
    chunk = prefill["long"]
    # The chunk is the longest the time left holds: one more token would have gone over.
    assert out.predicted_ms <= 10.0
    assert out.predicted_ms == pytest.approx(true_ms(out.batch.num_tokens, out.num_kv_tokens))
    assert true_ms(out.batch.num_tokens + 1, out.num_kv_tokens + 1) > 10.0
    assert 0 < chunk < out.step_token_cap - 26  # shorter than the tokens alone would allow
    # A row reads its context up to its last token: where each one's computed tokens now end.
    assert out.num_kv_tokens - out.num_top_kv_tokens == sum(
        r.num_computed_tokens for r, _ in out.scheduled_requests if r.req_id != "chat")


def test_the_feedback_still_shrinks_the_budget_when_steps_run_over() -> None:
    scheduler, runner, out = chat_beside_running_batch(itl_slowdown=1.5)
    budget: LatencyBudget = scheduler.latency_budget
    for _ in range(3):  # steps of the chat alone: the base its slowdown multiplies
        budget.observe(20, 20, true_ms(20, 20), was_capped=False, limit=256, kv_tokens=20, top_kv_tokens=20)
    first_target = budget.target_ms(20, 20)
    assert first_target == pytest.approx(1.5 * true_ms(20, 20))
    assert out.predicted_ms <= first_target
    # The engine measured the step at twice the slowdown over the chat alone: the batch's share shrinks.
    scheduler.observe_step(out, 2 * 1.5 * true_ms(20, 20))
    assert budget.guard == SHRINK and budget.target_ms(20, 20) < first_target
    num_over = 1
    for _ in range(4):  # the chat's decodes beside the batch, each step over
        later = step(scheduler, runner, {})
        assert later.num_top_tokens == 1 and later.batch.num_tokens > 1  # batch work still moves
        # The step was planned within its target; the engine measured twice that.
        target = budget.target_ms(later.num_top_tokens, later.num_top_kv_tokens)
        assert later.predicted_ms <= target
        scheduler.observe_step(later, 2 * target)
        num_over += 1
        assert budget.guard == pytest.approx(SHRINK ** num_over)
        assert budget.target_ms(later.num_top_tokens, later.num_top_kv_tokens) < target


def test_a_prefill_s_context_growing_with_its_tokens_is_not_charged_as_context() -> None:
    # Prefill steps of 2,100 to 4,000 tokens whose context is their tokens, beside decode steps
    # of 200 rows reading more or less context: the context's cost is the decodes' slope alone.
    cost = StepCost()
    for i in range(60):
        num_tokens = 2100 + 30 * i
        cost.observe(num_tokens, true_ms(num_tokens, num_tokens), num_tokens)
        kv_tokens = 200 * (300 + 10 * (i % 7))
        cost.observe(200, true_ms(200, kv_tokens), kv_tokens)
    assert cost.ms_per_kv_token == pytest.approx(MS_PER_KV_TOKEN, rel=1e-3)
    assert cost.predict(200, 80_000) == pytest.approx(true_ms(200, 80_000), rel=1e-3)
    # Prefill steps alone: their context never varies apart from their tokens: no slope.
    prefill = StepCost()
    for i in range(60):
        num_tokens = 2100 + 30 * i
        prefill.observe(num_tokens, true_ms(num_tokens, num_tokens), num_tokens)
    assert prefill.ms_per_kv_token == 0.0


def test_a_few_slow_noisy_steps_do_not_set_the_context_s_cost() -> None:
    cost = StepCost()
    for i in range(60):  # decode steps of 200 rows: the context's true cost
        kv_tokens = 200 * (300 + 10 * (i % 7))
        cost.observe(200, true_ms(200, kv_tokens), kv_tokens)
    # Three steps of about 80 tokens on a loaded host: slow, and slower by chance where they read more.
    for kv_tokens, ms in ((800, 60.0), (1400, 300.0), (2000, 500.0)):
        cost.observe(80, ms, kv_tokens)
    assert cost.ms_per_kv_token == pytest.approx(MS_PER_KV_TOKEN, rel=0.2)
