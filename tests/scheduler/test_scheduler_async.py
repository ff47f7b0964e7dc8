"""The scheduler under async scheduling: step n+1 is scheduled before step n's tokens are back,
with the same requests. A decode in both steps gets a pending input (the token step n samples,
which the fake runner, like the real one, takes from step n's samples, never from the host), so
stops, aborts and preemption act one step late: what the step ahead computed for a finished
request is dropped. The tokens, texts and finish reasons are those of one step at a time."""

from __future__ import annotations

import random
from collections import deque

from scheduler.request import FinishReason, RequestStatus
from shared.step import StepBatch, StepResult
from tests.scheduler.test_scheduler import (
    VOCAB,
    CharTokenizer,
    Collected,
    FakeRunner,
    make_request,
    make_scheduler,
    next_token_from_history,
    run_all,
)


class AsyncFakeRunner(FakeRunner):
    """A pending input is the token the previous step sampled for that request (as the real
    runner's device-side gather): a stale or missing one fails, or changes the output."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.last_sampled: dict[str, int] = {}  # req_id -> the previous step's sampled token
        self.num_pending = 0

    def __call__(self, batch: StepBatch) -> StepResult:
        for work in batch.works:
            if work.is_token_pending:
                assert len(work.token_ids) == 1 and work.req_id in self.last_sampled
                work.token_ids = [self.last_sampled[work.req_id]]
                self.num_pending += 1
        result = super().__call__(batch)
        self.last_sampled = {s.req_id: s.token_id for s in result.sampled}
        return result


def run_async(scheduler, requests, next_token=next_token_from_history, max_steps: int = 5000,
              on_step=None, runner: AsyncFakeRunner | None = None):
    """Two steps in flight with the same requests; the fake runner computes each when it is
    submitted (the device runs the steps in submission order)."""
    runner = runner or AsyncFakeRunner(scheduler.config.block_size, next_token)
    runner.tokens_of = lambda req_id: getattr(scheduler.get_request(req_id), "all_token_ids", None)
    for request in requests:
        scheduler.add_request(request)
    collected: dict[str, Collected] = {}
    in_flight: deque = deque()
    outs = []
    while scheduler.has_unfinished_requests() or in_flight:
        while len(in_flight) < 2:
            out = scheduler.schedule()
            if not out.batch.works:
                scheduler.update_from_output(out, runner(out.batch))
                break
            in_flight.append((out, runner(out.batch)))
            outs.append(out)
            if on_step is not None:
                on_step(scheduler, out)
        if not in_flight:
            continue
        out, result = in_flight.popleft()
        for output in scheduler.update_from_output(out, result):
            entry = collected.setdefault(output.req_id, Collected())
            assert entry.finish_reason is None, f"{output.req_id}: an output after its last"
            entry.token_ids += output.new_token_ids
            entry.text += output.text_delta
            entry.finish_reason, entry.stop_reason = output.finish_reason, output.stop_reason
        assert len(outs) < max_steps, "scheduler made no progress"
    assert scheduler.block_manager.num_free_blocks == scheduler.config.num_kv_blocks
    return collected, outs, runner


def mixed_requests(seed: int, num: int):
    """Prompts to 30 tokens, max_tokens 1-20, some with an EOS id, stop strings or a seed."""
    rng = random.Random(seed)
    requests = []
    for i in range(num):
        kind = i % 4
        extra = ({"eos": (rng.randrange(VOCAB),)} if kind == 1 else
                 {"stop": [CharTokenizer().decode([rng.randrange(26)])]} if kind == 2 else
                 {"temperature": 0.7, "seed": i} if kind == 3 else {})
        requests.append(make_request(f"r{i}", rng.randint(1, 30), rng.randrange(VOCAB), rng.randint(0, 2),
                                     float(i), max_tokens=rng.randint(1, 20), **extra))
    return requests


def _same(collected: dict[str, Collected], expected: dict[str, Collected]) -> None:
    assert set(collected) == set(expected)
    for req_id, want in expected.items():
        got = collected[req_id]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason), req_id


def test_async_steps_give_the_outputs_of_one_step_at_a_time() -> None:
    expected, _ = run_all(make_scheduler(CharTokenizer(), max_num_batched_tokens=16),
                          mixed_requests(seed=3, num=12), next_token_from_history)
    collected, outs, runner = run_async(make_scheduler(CharTokenizer(), max_num_batched_tokens=16,
                                                       async_scheduling=True),
                                        mixed_requests(seed=3, num=12))
    _same(collected, expected)
    assert runner.num_pending > 50  # most decodes were scheduled ahead of their token
    assert any(len(w.token_ids) > 1 for out in outs for w in out.batch.works)  # chunked prefills too


def test_async_steps_preempting_in_flight_requests_give_the_outputs_of_one_step_at_a_time() -> None:
    expected, _ = run_all(make_scheduler(CharTokenizer()), mixed_requests(seed=1, num=8),
                          next_token_from_history)
    tight = make_scheduler(CharTokenizer(), num_kv_blocks=14, async_scheduling=True)
    preempted_in_flight = []

    def note(scheduler, out):
        preempted_in_flight.extend(r for r in out.preempted_req_ids
                                   if scheduler.get_request(r).num_output_tokens)

    collected, outs, _ = run_async(tight, mixed_requests(seed=1, num=8), on_step=note)
    assert preempted_in_flight, "the tiny cache never preempted a decoding request"
    _same(collected, expected)


def test_the_token_computed_past_a_stop_is_dropped_never_returned_nor_counted() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    # Prompt 10..13: the fake model samples 14, 15, ...; 15 is EOS: two tokens, then stop.
    scheduler.add_request(make_request("r", num_prompt=4, first_token=10, eos=(15,), max_tokens=10))
    runner = AsyncFakeRunner(scheduler.config.block_size)
    steps = deque()
    outputs = []
    for _ in range(3):  # prefill, decode of 14 (ahead), decode of 15 (ahead: past the stop)
        out = scheduler.schedule()
        steps.append((out, runner(out.batch)))
        if len(steps) == 2:
            outputs += scheduler.update_from_output(*steps.popleft())
    assert [w.is_token_pending for out, _ in steps for w in out.batch.works] == [True]
    request = steps[0][0].scheduled_requests[0][0]
    assert request.status is RequestStatus.FINISHED_STOPPED and request.block_ids == []
    outputs += scheduler.update_from_output(*steps.popleft())  # the step past the stop
    assert [o.new_token_ids for o in outputs] == [[14], [15]] and outputs[-1].finished
    assert request.output_token_ids == [14, 15] and not scheduler.has_unfinished_requests()
    assert scheduler.block_manager.num_free_blocks == scheduler.config.num_kv_blocks


def test_blocks_cover_the_pending_tokens_position() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    scheduler.add_request(make_request("r", num_prompt=4, max_tokens=10))  # one full block
    first = scheduler.schedule()
    ahead = scheduler.schedule()
    [work] = ahead.batch.works
    assert work.is_token_pending and work.start_pos == 4 and work.is_sampled
    assert len(work.block_ids) == 2  # position 4 opens the second block before token 4 is known
    assert work.num_output_tokens == 1  # its seeded stream comes after the pending token's
    request = first.scheduled_requests[0][0]
    assert (request.num_in_flight_tokens, request.num_pending_tokens) == (5, 2)


def test_a_pending_token_that_is_the_last_is_not_scheduled_ahead() -> None:
    scheduler = make_scheduler(async_scheduling=True, max_num_batched_tokens=2048)
    scheduler.add_request(make_request("last", max_tokens=1))
    # Its pending token is the last that max_model_len (1024) allows.
    scheduler.add_request(make_request("window", num_prompt=1023, first_token=100, max_tokens=50))
    scheduler.add_request(make_request("more", first_token=200, max_tokens=2))
    scheduler.schedule()
    ahead = scheduler.schedule()
    assert [w.req_id for w in ahead.batch.works] == ["more"]


def test_requests_with_penalties_are_scheduled_ahead_without_their_pending_token_in_the_history() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    scheduler.add_request(make_request("penalized", max_tokens=5, temperature=0.0, frequency_penalty=0.5))
    scheduler.add_request(make_request("plain", max_tokens=5))
    runner = AsyncFakeRunner(scheduler.config.block_size)
    first = scheduler.schedule()
    assert not scheduler.has_requests_needing_their_token()
    ahead = scheduler.schedule()
    assert [w.req_id for w in ahead.batch.works] == ["penalized", "plain"]
    work = ahead.batch.works[0]
    # The runner counts the pending token on the device (workers/sampler.py); the history the
    # scheduler knows is sent as it is.
    assert work.is_token_pending and work.output_token_ids == [] and len(work.prompt_token_ids) == 4
    scheduler.update_from_output(first, runner(first.batch))
    scheduler.update_from_output(ahead, runner(ahead.batch))
    after = scheduler.schedule()
    work = next(w for w in after.batch.works if w.req_id == "penalized")
    assert not work.is_token_pending and work.output_token_ids == [14, 15]


def test_abort_while_the_step_ahead_is_in_flight_reports_once_and_frees_its_blocks() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", first_token=10 * i, max_tokens=6))
    runner = AsyncFakeRunner(scheduler.config.block_size)
    first = scheduler.schedule()
    first_result = runner(first.batch)
    ahead = scheduler.schedule()
    ahead_result = runner(ahead.batch)
    scheduler.abort_request("r1")  # in both steps
    outputs = scheduler.update_from_output(first, first_result)
    outputs += scheduler.update_from_output(ahead, ahead_result)
    aborted = [o for o in outputs if o.req_id == "r1"]
    assert [(o.new_token_ids, o.finish_reason) for o in aborted] == [([], FinishReason.ABORT)]
    collected, _, _ = run_async(scheduler, [], runner=runner)
    assert "r1" not in collected
    assert scheduler.block_manager.num_free_blocks == scheduler.config.num_kv_blocks


def test_without_async_scheduling_a_request_is_in_one_step_at_a_time() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", max_tokens=5))
    scheduler.schedule()
    assert scheduler.schedule().batch.works == []


def test_a_newcomer_waits_for_the_prefix_a_step_in_flight_computes_then_takes_it_from_the_cache() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    runner = AsyncFakeRunner(scheduler.config.block_size)
    scheduler.add_request(make_request("first", num_prompt=9, max_tokens=4))  # two full blocks
    first = scheduler.schedule()
    first_result = runner(first.batch)
    scheduler.add_request(make_request("second", num_prompt=9, max_tokens=4))  # the same prompt
    ahead = scheduler.schedule()
    assert [w.req_id for w in ahead.batch.works] == ["first"]  # not computing the prefix again
    scheduler.update_from_output(first, first_result)
    after = scheduler.schedule()
    second = next(w for w in after.batch.works if w.req_id == "second")
    assert second.start_pos == 8 and second.token_ids == [18]  # after the two cached blocks
