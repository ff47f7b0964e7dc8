"""Tenants take turns inside a priority; priorities stay strict; one tenant keeps arrival order."""

from __future__ import annotations

from scheduler.request import Request
from shared.sampling import SamplingParams
from tests.scheduler.test_scheduler import FakeRunner, make_scheduler, step


def tenant_request(req_id: str, tenant: str | None, arrival_time: float, priority: int = 0,
                   max_tokens: int = 1) -> Request:
    return Request(req_id, [10, 11, 12, 13], SamplingParams(max_tokens=max_tokens), priority, arrival_time,
                   tenant=tenant)


def first_step_of(scheduler, requests: list[Request], watched: str, max_steps: int = 1000) -> int:
    """The step (counted from 1) in which `watched` is first scheduled."""
    for request in requests:
        scheduler.add_request(request)
    runner = FakeRunner(scheduler.config.block_size)
    for number in range(1, max_steps + 1):
        if watched in step(scheduler, runner, {}).scheduled_req_ids:
            return number
    raise AssertionError(f"{watched} never ran")


def test_a_newcomer_tenant_starts_within_one_turn_of_a_500_request_backlog() -> None:
    backlog = [tenant_request(f"a{i}", "team-a", float(i)) for i in range(500)]
    newcomer = tenant_request("b0", "team-b", 1000.0)
    # One new sequence per step: the backlog is what decides who goes next.
    loaded = first_step_of(make_scheduler(max_num_seqs=1), [*backlog, newcomer], "b0")
    idle = first_step_of(make_scheduler(max_num_seqs=1), [tenant_request("b0", "team-b", 1000.0)], "b0")
    assert idle == 1
    assert loaded <= idle + 1  # team-a's head may start first; team-b's request is next


def test_without_tenants_a_late_request_waits_its_turn_in_arrival_order() -> None:
    # The same load with no tenants is one flow: arrival order, so the late request is last.
    backlog = [tenant_request(f"a{i}", None, float(i)) for i in range(20)]
    late = tenant_request("late", None, 1000.0)
    assert first_step_of(make_scheduler(max_num_seqs=1), [*backlog, late], "late") == 21


def test_tenants_alternate_and_each_keeps_its_own_arrival_order() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    requests = [tenant_request(f"a{i}", "a", float(i)) for i in range(4)]
    requests += [tenant_request(f"b{i}", "b", 10.0 + i) for i in range(2)]
    for request in requests:
        scheduler.add_request(request)
    runner = FakeRunner(scheduler.config.block_size)
    order = [step(scheduler, runner, {}).scheduled_req_ids[0] for _ in range(6)]
    assert order == ["a0", "b0", "a1", "b1", "a2", "a3"]


def test_priorities_stay_strict_across_tenants() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    requests = [tenant_request("low-a", "a", 0.0, priority=1), tenant_request("high-b", "b", 5.0, priority=0),
                tenant_request("high-a", "a", 6.0, priority=0)]
    for request in requests:
        scheduler.add_request(request)
    runner = FakeRunner(scheduler.config.block_size)
    order = [step(scheduler, runner, {}).scheduled_req_ids[0] for _ in range(3)]
    assert order == ["high-b", "high-a", "low-a"]


def test_an_idle_tenant_banks_no_credit() -> None:
    # b ran nothing while a ran 10; afterwards they alternate (b first: a used the last turn)
    # instead of b taking 10 in a row.
    scheduler = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(scheduler.config.block_size)
    for i in range(10):
        scheduler.add_request(tenant_request(f"early{i}", "a", float(i)))
    for _ in range(10):
        step(scheduler, runner, {})
    for i in range(3):
        scheduler.add_request(tenant_request(f"a{i}", "a", 100.0 + i))
        scheduler.add_request(tenant_request(f"b{i}", "b", 100.5 + i))
    order = [step(scheduler, runner, {}).scheduled_req_ids[0] for _ in range(6)]
    assert order == ["b0", "a0", "b1", "a1", "b2", "a2"]
