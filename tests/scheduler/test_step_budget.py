"""Batch prefill beside interactive work: capped to the step's latency budget; the whole budget
without interactive work; interactive arrivals first, taking a batch item's slot (which resumes
with the same tokens); priorities by the same rule."""

from __future__ import annotations

import json

import pytest

from scheduler.request import BATCH_PRIORITY
from scheduler.scheduler import Scheduler
from scheduler.step_budget import (
    BATCH_STEP_EFFICIENCY,
    BATCH_STEP_MS,
    FALLBACK_STEP_TOKENS,
    LINGER_S,
    MAX_GUARD,
    MIN_ALLOWANCE_TOKENS,
    MIN_GUARD,
    SHRINK,
    LatencyBudget,
)
from scheduler.step_cost import StepCost
from tests.scheduler.test_scheduler import (
    Collected,
    FakeRunner,
    make_request,
    make_scheduler,
    next_token_from_history,
    run_all,
    step,
)


def linear_cost(ms_per_token: float = 0.1, fixed_ms: float = 1.0) -> StepCost:
    """A cost model that has seen steps costing fixed_ms + ms_per_token * tokens."""
    cost = StepCost()
    for num_tokens in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        cost.observe(num_tokens, fixed_ms + ms_per_token * num_tokens)
    return cost


def budgeted_scheduler(**overrides) -> Scheduler:
    overrides.setdefault("max_num_batched_tokens", 256)
    overrides.setdefault("max_num_seqs", 16)
    scheduler = make_scheduler(**overrides)
    scheduler.latency_budget.cost = linear_cost()
    return scheduler


def batch_tokens(out) -> int:
    """Tokens of batch items in a step."""
    return sum(out.num_scheduled_tokens[request.req_id] for request, _ in out.scheduled_requests
               if request.priority >= BATCH_PRIORITY)


# -- the cost model -------------------------------------------------------------------


def test_cost_model_interpolates_never_decreases_and_inverts() -> None:
    cost = StepCost()
    assert cost.predict(100) is None and cost.max_tokens_within(10.0, 1000) is None
    cost.observe(10, 5.0)
    assert cost.predict(5) == 5.0  # below the first point: its time (a decode's floor)
    assert cost.predict(20) == pytest.approx(10.0)  # one point: scaled with the tokens
    cost.observe(100, 6.0)
    cost.observe(1000, 42.0)
    assert cost.predict(55) == pytest.approx(5.5)
    assert cost.predict(550) == pytest.approx(24.0)
    assert cost.predict(2000) == pytest.approx(82.0)  # the last segment extended
    assert cost.max_tokens_within(24.0, 4096) == 550
    assert cost.max_tokens_within(4.0, 4096) == 0
    assert cost.max_tokens_within(1e9, 4096) == 4096
    cost.observe(300, 3.0)  # (a cheap outlier: a step never costs less for more tokens)
    assert cost.predict(300) >= cost.predict(100)


def test_cost_model_follows_a_change_in_step_times() -> None:
    cost = StepCost()
    cost.observe(64, 10.0)
    for _ in range(60):
        cost.observe(64, 4.0)
    assert cost.predict(64) == pytest.approx(4.0, abs=0.05)
    cost.observe(64, 400.0)  # one long pause: counted as 3x the mean at most
    assert cost.predict(64) == pytest.approx(4.0 + 0.1 * (12.0 - 4.0), abs=0.05)


def test_latency_budget_absolute_auto_off_and_before_any_step() -> None:
    cost = linear_cost()  # 1 ms + 0.1 ms per token
    assert LatencyBudget(itl_target_ms=10.0, cost=cost).step_tokens(20, 8192) == 90
    # auto: 1.5 x a step of 40 tokens (5 ms) = 7.5 ms: 65 tokens
    assert LatencyBudget(slowdown=1.5, cost=cost).step_tokens(40, 8192) == 65
    assert LatencyBudget(itl_target_ms=0, cost=cost).step_tokens(40, 8192) == 8192
    assert LatencyBudget().step_tokens(40, 8192) == FALLBACK_STEP_TOKENS
    assert LatencyBudget().step_tokens(40, 100) == 100
    with pytest.raises(ValueError):
        LatencyBudget(slowdown=0.5)


# -- batch beside interactive ---------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_batch_prefill_stays_under_the_cap_while_a_chat_runs_and_gets_the_whole_budget_after() -> None:
    scheduler = budgeted_scheduler(itl_target_ms=10.0)  # 90 tokens a step beside the chat
    clock = scheduler.latency_budget.recent_top.clock = FakeClock()
    runner = FakeRunner()
    for i in range(8):
        scheduler.add_request(make_request(f"b{i}", num_prompt=400, first_token=7 * i,
                                           priority=BATCH_PRIORITY, arrival_time=float(i), max_tokens=4))
    scheduler.add_request(make_request("chat", num_prompt=30, first_token=500, priority=0,
                                       arrival_time=0.5, max_tokens=4))
    collected: dict[str, Collected] = {}
    with_chat, lingering, without_chat = [], [], []
    while scheduler.has_unfinished_requests():
        chat_present = scheduler.get_request("chat") is not None
        if not chat_present and len(lingering) == 3:
            clock.now += LINGER_S + 0.01  # the chat left longer ago than the linger
        out = step(scheduler, runner, collected)
        (with_chat if chat_present else lingering if len(lingering) < 3 else without_chat).append(out)
    first = with_chat[0]
    # The chat's whole prompt goes first; the batch fills the step up to 90 tokens.
    assert first.num_scheduled_tokens["chat"] == 30
    assert first.batch.num_tokens == 90 and first.step_token_cap == 90
    for out in with_chat:
        assert out.batch.num_tokens <= 90
        assert batch_tokens(out) > 0  # the batch still makes progress
    # Right after the chat left (another may come any moment) the cap holds: 90 tokens.
    assert [out.step_token_cap for out in lingering] == [90, 90, 90]
    assert all(out.batch.num_tokens <= 90 for out in lingering)
    # The linger over, batch prompts take the whole 256-token budget again.
    assert max(out.batch.num_tokens for out in without_chat) == 256
    assert all(out.step_token_cap is None for out in without_chat)
    assert collected["chat"].finish_reason is not None
    assert all(collected[f"b{i}"].finish_reason is not None for i in range(8))


def test_without_interactive_work_batch_items_fill_the_whole_budget() -> None:
    scheduler = budgeted_scheduler(itl_target_ms=10.0)
    requests = [make_request(f"b{i}", num_prompt=200, first_token=i, priority=BATCH_PRIORITY,
                             arrival_time=float(i)) for i in range(4)]
    _, outs = run_all(scheduler, requests)
    assert outs[0].batch.num_tokens == 256 and outs[0].step_token_cap is None


def test_batch_work_alone_runs_in_steps_of_at_most_the_batch_step_time_every_decode_included() -> None:
    # 1 ms + 0.5 ms a token: the whole 256-token budget would be a 129 ms step.
    scheduler = budgeted_scheduler(max_num_seqs=120)
    scheduler.latency_budget.cost = linear_cost(ms_per_token=0.5)
    within = int((BATCH_STEP_MS - 1.0) / 0.5)  # 98 tokens
    requests = [make_request(f"b{i}", num_prompt=150, first_token=i, priority=BATCH_PRIORITY,
                             arrival_time=float(i), max_tokens=3) for i in range(110)]
    collected, outs = run_all(scheduler, requests)
    assert outs[0].batch.num_tokens == within and outs[0].step_token_cap is None
    assert all(collected[f"b{i}"].finish_reason is not None for i in range(110))
    assert max(out.batch.num_tokens for out in outs) == within
    # More decodes running than the time holds: every one of them still runs.
    assert scheduler.latency_budget.batch_step_tokens(256, num_decodes=110) == 110
    assert scheduler.latency_budget.batch_step_tokens(256, num_decodes=300) == 256
    # With the budget off, the whole budget.
    off = budgeted_scheduler(itl_target_ms=0)
    off.latency_budget.cost = linear_cost(ms_per_token=0.5)
    _, outs = run_all(off, [make_request(f"b{i}", num_prompt=150, first_token=i, priority=BATCH_PRIORITY,
                                         arrival_time=float(i), max_tokens=3) for i in range(4)])
    assert outs[0].batch.num_tokens == 256


def test_where_no_step_is_within_the_batch_step_time_batch_work_still_runs_at_near_full_rate() -> None:
    # A loaded CPU: 60 ms a step before its first token, so not one token fits in 50 ms. The
    # batch step is then the fewest tokens at 90% of a whole budget's tokens per ms, never none.
    scheduler = budgeted_scheduler()
    scheduler.latency_budget.cost = linear_cost(ms_per_token=0.5, fixed_ms=60.0)
    assert scheduler.latency_budget.cost.max_tokens_within(BATCH_STEP_MS, 256) == 0
    rate = 256 / (60.0 + 0.5 * 256)
    efficient = scheduler.latency_budget.batch_step_tokens(256, num_decodes=0)
    assert efficient / (60.0 + 0.5 * efficient) >= BATCH_STEP_EFFICIENCY * rate
    assert (efficient - 1) / (60.0 + 0.5 * (efficient - 1)) < BATCH_STEP_EFFICIENCY * rate
    requests = [make_request(f"b{i}", num_prompt=150, first_token=i, priority=BATCH_PRIORITY,
                             arrival_time=float(i), max_tokens=3) for i in range(3)]
    collected, outs = run_all(scheduler, requests)
    assert outs[0].batch.num_tokens == efficient
    assert all(collected[f"b{i}"].finish_reason is not None for i in range(3))


def test_batch_decodes_past_the_cap_skip_the_step_and_go_first_in_the_next() -> None:
    scheduler = budgeted_scheduler(itl_target_ms=6.0, max_num_seqs=16)  # 50 tokens a step
    runner = FakeRunner()
    for i in range(12):
        scheduler.add_request(make_request(f"b{i}", num_prompt=4, first_token=i, priority=BATCH_PRIORITY,
                                           arrival_time=float(i), max_tokens=30))
    step(scheduler, runner, {})  # 12 batch prompts (48 tokens): nothing to cap yet
    scheduler.add_request(make_request("chat", num_prompt=40, first_token=500, arrival_time=20.0))
    out = step(scheduler, runner, {})
    assert out.num_scheduled_tokens["chat"] == 40  # the chat's prefill is never capped
    ran = {f"b{i}" for i in range(12)} & set(out.num_scheduled_tokens)
    assert len(ran) == 10 and out.batch.num_tokens == 50 and out.was_capped  # 2 decodes wait
    out = step(scheduler, runner, {})  # the chat decodes: 1 + 12 batch decodes fit in 50
    left_out = {f"b{i}" for i in range(12)} - ran
    assert left_out <= set(out.num_scheduled_tokens) and out.batch.num_tokens == 13


def test_the_decodes_left_out_longest_go_first() -> None:
    scheduler = budgeted_scheduler(itl_target_ms=1.7, max_num_seqs=16)  # 7 tokens a step
    runner = FakeRunner()
    for i in range(12):
        scheduler.add_request(make_request(f"b{i}", num_prompt=4, first_token=i, priority=BATCH_PRIORITY,
                                           arrival_time=float(i), max_tokens=30))
    step(scheduler, runner, {})
    scheduler.add_request(make_request("chat", num_prompt=2, first_token=500, arrival_time=20.0))
    first = set(step(scheduler, runner, {}).num_scheduled_tokens) - {"chat"}  # 2 + 5 batch decodes
    second = set(step(scheduler, runner, {}).num_scheduled_tokens) - {"chat"}  # 1 + 6
    assert len(first) == 5 and len(second) == 6 and first.isdisjoint(second)
    third = set(step(scheduler, runner, {}).num_scheduled_tokens) - {"chat"}
    assert third >= {f"b{i}" for i in range(12)} - first - second  # every decode runs within three steps


def test_the_auto_guard_shrinks_the_batch_share_after_slow_steps_and_grows_it_back_after_fast_capped_ones(
) -> None:
    budget = LatencyBudget(slowdown=1.5, cost=linear_cost())
    for _ in range(5):  # the chats alone: 40 tokens in 5 ms
        budget.observe(40, 40, 5.0, was_capped=False, limit=8192)
    assert budget.target_ms(40) == pytest.approx(7.5)  # the whole share: 1.5 x 5 ms
    assert budget.step_tokens(40, 8192) == 65  # 7.5 ms by the cost curve, before any step beside
    budget.observe(100, 40, 20.0, was_capped=True, limit=8192)  # 20 ms: far over 7.5
    assert budget.guard == SHRINK and budget.target_ms(40) == pytest.approx(5.0 * (1 + SHRINK * 0.5))
    assert budget.step_tokens(40, 8192) < 65
    for _ in range(30):
        budget.observe(100, 40, 20.0, was_capped=True, limit=8192)
    assert budget.guard == MIN_GUARD  # never nothing: batch items keep moving
    assert budget.cap(40, 0, 8192).chunk_within(40, 0, 0, 8) >= 1  # one row beside the chats, always
    for _ in range(30):  # within 1.5 x 5 ms, and the cap held work back: it grows again
        budget.observe(45, 40, 6.0, was_capped=True, limit=8192)
    assert budget.guard > 3 * MIN_GUARD
    grown = budget.guard
    budget.observe(45, 40, 6.0, was_capped=False, limit=8192)  # nothing held back: no reason to grow
    assert budget.guard == grown
    for _ in range(200):
        budget.observe(45, 40, 6.0, was_capped=True, limit=8192)
    assert budget.guard == MAX_GUARD  # a model predicting too long is corrected, up to a bound


def test_interactive_prefill_goes_before_a_running_batch_prefill() -> None:
    scheduler = budgeted_scheduler(itl_target_ms=10.0)
    runner = FakeRunner()
    scheduler.add_request(make_request("batch", num_prompt=600, priority=BATCH_PRIORITY, max_tokens=2))
    assert step(scheduler, runner, {}).num_scheduled_tokens["batch"] == 256  # alone: the whole budget
    scheduler.add_request(make_request("chat", num_prompt=70, first_token=500, arrival_time=5.0))
    out = step(scheduler, runner, {})
    assert out.num_scheduled_tokens["chat"] == 70
    assert out.num_scheduled_tokens["batch"] == 20  # what the 90-token step leaves


def test_auto_budget_keeps_a_step_within_the_slowdown_of_the_chats_alone() -> None:
    scheduler = budgeted_scheduler(itl_slowdown=1.5)
    runner = FakeRunner()
    for i in range(4):
        scheduler.add_request(make_request(f"b{i}", num_prompt=300, first_token=i, priority=BATCH_PRIORITY,
                                           arrival_time=float(i)))
    scheduler.add_request(make_request("chat", num_prompt=40, first_token=500, arrival_time=0.5))
    out = step(scheduler, runner, {})
    # The chat alone: 40 tokens, 5 ms; the step may take 7.5 ms: 65 tokens.
    assert out.num_scheduled_tokens["chat"] == 40 and out.batch.num_tokens == 65


def test_off_lets_batch_prompts_share_the_step_as_they_fit() -> None:
    scheduler = budgeted_scheduler(itl_target_ms=0)
    for i in range(4):
        scheduler.add_request(make_request(f"b{i}", num_prompt=300, first_token=i, priority=BATCH_PRIORITY,
                                           arrival_time=float(i)))
    scheduler.add_request(make_request("chat", num_prompt=40, first_token=500, arrival_time=0.5))
    assert step(scheduler, FakeRunner(), {}).batch.num_tokens == 256


# -- preemption, resume ---------------------------------------------------------------


def test_a_chat_arriving_when_batch_items_hold_every_slot_preempts_one_that_resumes_identically() -> None:
    def run(with_chat: bool) -> dict[str, Collected]:
        scheduler = budgeted_scheduler(itl_target_ms=10.0, max_num_seqs=3)
        runner = FakeRunner(next_token=next_token_from_history)
        collected: dict[str, Collected] = {}
        for i in range(3):
            scheduler.add_request(make_request(f"b{i}", num_prompt=9, first_token=11 * i,
                                               priority=BATCH_PRIORITY, arrival_time=float(i), max_tokens=15))
        for _ in range(4):
            step(scheduler, runner, collected)
        if with_chat:
            scheduler.add_request(make_request("chat", num_prompt=6, first_token=500, arrival_time=9.0,
                                               max_tokens=5))
            out = step(scheduler, runner, collected)
            assert out.preempted_req_ids == ["b2"]  # the least important: the latest batch item
            assert "chat" in out.num_scheduled_tokens  # its first token in this very step
            assert scheduler.get_request("b2").num_preemptions == 1
        while scheduler.has_unfinished_requests():
            step(scheduler, runner, collected)
        return collected

    alone, beside = run(False), run(True)
    for req_id in ("b0", "b1", "b2"):
        assert beside[req_id].token_ids == alone[req_id].token_ids  # resumed: nothing lost, nothing twice
        assert len(beside[req_id].token_ids) == 15
    assert len(beside["chat"].token_ids) == 5


# -- priorities -----------------------------------------------------------------------


def test_higher_priority_prefill_goes_first_and_lower_priorities_are_capped() -> None:
    scheduler = budgeted_scheduler(itl_target_ms=10.0)
    runner = FakeRunner()
    scheduler.add_request(make_request("p5", num_prompt=500, priority=5, max_tokens=2))
    assert step(scheduler, runner, {}).num_scheduled_tokens["p5"] == 256
    scheduler.add_request(make_request("p2", num_prompt=100, first_token=300, priority=2, arrival_time=2.0))
    scheduler.add_request(make_request("p0", num_prompt=60, first_token=600, priority=0, arrival_time=3.0))
    out = step(scheduler, runner, {})
    # p0 (most important) whole; then p2, then p5 within the 90-token step, in priority order.
    assert list(out.num_scheduled_tokens) == ["p0", "p2"]
    assert out.num_scheduled_tokens == {"p0": 60, "p2": 30}
    # Equal priorities share the step as before: no cap without anything less important.
    scheduler = budgeted_scheduler(itl_target_ms=10.0)
    for i in range(3):
        scheduler.add_request(make_request(f"i{i}", num_prompt=80, first_token=100 * i,
                                           arrival_time=float(i)))
    out = step(scheduler, FakeRunner(), {})
    assert out.batch.num_tokens == 240 and out.step_token_cap is None


# -- the in-process engine ------------------------------------------------------------


def test_engine_preempts_a_batch_item_for_a_chat_and_the_item_resumes_with_transformers_tokens(
        tiny_checkpoints) -> None:
    from scheduler.engine import LLMEngine
    from service.telemetry import SchedulerTelemetry
    from shared.config import EngineConfig
    from shared.sampling import SamplingParams
    from tests.hf_reference import assert_greedy_matches
    from tests.scheduler.test_engine import _prompts, _references

    folder = tiny_checkpoints["llama"]
    batch_prompts, [chat_prompt] = _prompts(4, 512, [21, 13, 30]), _prompts(5, 512, [9])
    refs = _references(folder, [*batch_prompts, chat_prompt], max_new_tokens=24)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    config = EngineConfig(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=256,
                          max_num_seqs=3, max_num_batched_tokens=16, itl_slowdown=1.5)
    with LLMEngine(config) as engine:
        assert engine.scheduler.latency_budget.slowdown == 1.5
        batch_ids = [engine.add_request(p, greedy, priority=BATCH_PRIORITY, arrival_time=float(i))
                     for i, p in enumerate(batch_prompts)]
        tokens: dict[str, list[int]] = {req_id: [] for req_id in batch_ids}
        while min(len(t) for t in tokens.values()) < 4:  # every batch item decoding, every slot taken
            for out in engine.step():
                tokens[out.req_id].extend(out.new_token_ids)
        chat = engine.add_request(chat_prompt, greedy, arrival_time=100.0)
        tokens[chat] = []
        victim = engine.scheduler.get_request(batch_ids[-1])  # the latest batch item
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.req_id].extend(out.new_token_ids)
        assert engine.scheduler.step_cost.is_known  # the engine timed its steps
        # ... and a scheduler's heartbeat says what it learned.
        heartbeat = SchedulerTelemetry(engine, "tiny", "s1").heartbeat_fields()
        points = json.loads(heartbeat["step_cost_ms"])
        assert points and all(tokens >= 1 and ms > 0 for tokens, ms in points)
    assert victim.num_preemptions == 1
    for req_id, ref in zip([*batch_ids, chat], refs, strict=True):
        assert_greedy_matches(tokens[req_id], ref, allow_near_tie=True)


def test_batch_decodes_count_against_the_auto_budget_and_do_not_raise_it() -> None:
    scheduler = budgeted_scheduler(itl_slowdown=1.5, max_num_seqs=64)
    runner = FakeRunner()
    for i in range(40):
        scheduler.add_request(make_request(f"b{i}", num_prompt=4, first_token=i, priority=BATCH_PRIORITY,
                                           arrival_time=float(i), max_tokens=50))
    step(scheduler, runner, {})  # 40 batch prompts: every one decoding from now on
    scheduler.add_request(make_request("late", num_prompt=100, priority=BATCH_PRIORITY, arrival_time=50.0))
    scheduler.add_request(make_request("chat", num_prompt=40, first_token=500, arrival_time=60.0))
    out = step(scheduler, runner, {})
    # The chat alone: 40 tokens, 5 ms; the step may hold 65: 25 of the batch's 40 decodes, and no
    # room for the late batch prompt.
    assert out.num_scheduled_tokens["chat"] == 40 and out.step_token_cap == 65
    assert "late" not in out.num_scheduled_tokens and out.batch.num_tokens == 65


def test_with_an_absolute_target_below_the_chats_own_step_batch_work_still_moves() -> None:
    budget = LatencyBudget(itl_target_ms=2.0, cost=linear_cost())  # 10 tokens fit in 2 ms
    assert budget.step_tokens(40, 8192) == 40 + MIN_ALLOWANCE_TOKENS  # not 10: nothing would move
    assert budget.step_tokens(4, 8192) == 10


def test_a_reset_forgets_the_alone_curve_and_the_guard_too() -> None:
    budget = LatencyBudget(cost=linear_cost())
    budget.observe(40, 40, 500.0, was_capped=False, limit=8192)  # a compiling warm-up step
    budget.observe(100, 40, 5000.0, was_capped=True, limit=8192)
    assert budget.alone_cost.is_known and budget.guard < 1
    budget.reset()
    assert not budget.cost.is_known and not budget.alone_cost.is_known and budget.guard == 1.0
