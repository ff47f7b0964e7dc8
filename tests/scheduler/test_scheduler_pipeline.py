"""The scheduler with steps in flight (a pipeline's): the next step is scheduled before the
previous one's tokens are back. Requests of a step in flight stay out of the next one and
are never preempted, the steps in flight split the requests between them, and the tokens
are those of one step at a time."""

from __future__ import annotations

from collections import deque

from tests.scheduler.test_scheduler import (
    CharTokenizer,
    Collected,
    FakeRunner,
    make_request,
    make_scheduler,
    next_token_from_history,
    random_requests,
    run_all,
)


def run_pipelined(scheduler, requests, depth: int, next_token=next_token_from_history, max_steps: int = 5000):
    """Keep `depth` steps in flight; the fake runner computes each at submission (the stages
    run the steps in submission order, so that is when its KV is written)."""
    runner = FakeRunner(scheduler.config.block_size, next_token)
    runner.tokens_of = lambda req_id: getattr(scheduler.get_request(req_id), "all_token_ids", None)
    for request in requests:
        scheduler.add_request(request)
    collected: dict[str, Collected] = {}
    in_flight: deque = deque()
    outs = []
    while scheduler.has_unfinished_requests() or in_flight:
        while len(in_flight) < depth:
            out = scheduler.schedule()
            if not out.batch.works:
                scheduler.update_from_output(out, runner(out.batch))
                break
            busy = {req_id for other, _ in in_flight for req_id in other.num_scheduled_tokens}
            assert not busy & set(out.num_scheduled_tokens), "a request in two steps in flight"
            assert not busy & set(out.preempted_req_ids), "a request in flight was preempted"
            in_flight.append((out, runner(out.batch)))
            outs.append((out, len(in_flight)))
        if not in_flight:
            continue
        out, result = in_flight.popleft()
        for output in scheduler.update_from_output(out, result):
            entry = collected.setdefault(output.req_id, Collected())
            entry.token_ids += output.new_token_ids
            entry.text += output.text_delta
        assert len(outs) < max_steps, "scheduler made no progress"
    assert scheduler.block_manager.num_free_blocks == scheduler.config.num_kv_blocks
    return collected, outs


def test_two_steps_in_flight_give_the_tokens_of_one_at_a_time_even_when_preempting() -> None:
    one_at_a_time, _ = run_all(make_scheduler(CharTokenizer()), random_requests(seed=1, num=8),
                               next_token_from_history)
    tight = make_scheduler(CharTokenizer(), num_kv_blocks=14, pipeline_depth=2)  # forces preemption
    pipelined, outs = run_pipelined(tight, random_requests(seed=1, num=8), depth=2)
    assert sum(len(out.preempted_req_ids) for out, _ in outs) > 0
    expected = {r: c.token_ids for r, c in one_at_a_time.items()}
    assert {r: c.token_ids for r, c in pipelined.items()} == expected
    assert all(c.text == CharTokenizer().decode(c.token_ids) for c in pipelined.values())


def test_the_steps_in_flight_split_the_requests_evenly() -> None:
    scheduler = make_scheduler(pipeline_depth=2, max_num_seqs=8)
    requests = [make_request(f"r{i}", num_prompt=4, first_token=10 * i, max_tokens=12) for i in range(6)]
    _, outs = run_pipelined(scheduler, requests, depth=2)
    sizes = [len(out.batch.works) for out, _ in outs]
    assert sizes[:2] == [3, 3]  # six requests: three in each step in flight, not six and none
    assert max(depth for _, depth in outs) == 2
    # In steady state every step has its half (until requests finish).
    assert all(size == 3 for size in sizes[:20]), sizes[:20]


def test_one_step_at_a_time_is_unchanged_by_the_pipeline_bookkeeping() -> None:
    scheduler = make_scheduler(max_num_seqs=8)
    requests = [make_request(f"r{i}", num_prompt=4, first_token=10 * i, max_tokens=12) for i in range(6)]
    _, outs = run_pipelined(scheduler, requests, depth=1)
    assert len(outs[0][0].batch.works) == 6


def test_a_request_aborted_while_in_flight_drops_that_steps_token_and_frees_its_blocks() -> None:
    scheduler = make_scheduler(pipeline_depth=2)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", num_prompt=4, first_token=10 * i, max_tokens=3))
    runner = FakeRunner(scheduler.config.block_size)
    first, second = scheduler.schedule(), scheduler.schedule()
    assert len(first.batch.works) == len(second.batch.works) == 2
    victim = first.batch.works[0].req_id
    scheduler.abort_request(victim)  # its step is still in flight
    outputs = scheduler.update_from_output(first, runner(first.batch))
    assert [o.req_id for o in outputs if o.finished] == [victim]  # reported aborted, no token
    assert all(o.new_token_ids == [] for o in outputs if o.req_id == victim)
    scheduler.update_from_output(second, runner(second.batch))
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner(out.batch))
    assert scheduler.block_manager.num_free_blocks == scheduler.config.num_kv_blocks
