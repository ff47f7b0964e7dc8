"""The scaling decision alone: signals in, desired replicas (and the replica to drain) out."""

from __future__ import annotations

import pytest

from shared.errors import InvalidRequestError
from tokenfleet.autoscale.policy import (
    Decision,
    FleetSignals,
    PolicyState,
    ReplicaLoad,
    ScalingPolicy,
    decide,
)

POLICY = ScalingPolicy(min_replicas=1, max_replicas=3, target_queue_per_replica=4, target_wait_s=2.0,
                       scale_down_load=0.5, scale_up_cooldown_s=5, scale_down_cooldown_s=10)


def _replicas(*loads: int, max_num_seqs: int = 8, draining: tuple[str, ...] = ()) -> tuple[ReplicaLoad, ...]:
    return tuple(ReplicaLoad(f"m-r{i}", load, 0, max_num_seqs, f"m-r{i}" in draining)
                 for i, load in enumerate(loads))


def _signals(queued: int = 0, age: float = 0.0, loads: tuple[int, ...] = (0,), starting: int = 0,
             draining: tuple[str, ...] = ()) -> FleetSignals:
    return FleetSignals(queued, age, _replicas(*loads, draining=draining), starting)


def _run(state: PolicyState, steps: list[tuple[float, FleetSignals]]) -> tuple[PolicyState, list[Decision]]:
    decisions = []
    for now, signals in steps:
        state, decision = decide(POLICY, state, signals, now)
        decisions.append(decision)
    return state, decisions


def test_queue_past_its_target_adds_one_replica():
    state, decision = decide(POLICY, PolicyState(1), _signals(queued=5, loads=(8,)), 100.0)
    assert (decision.desired, decision.drain_replica_id) == (2, None)
    assert "5 waiting" in decision.reason and state.desired == 2


def test_queue_at_its_target_adds_nothing():
    _, decision = decide(POLICY, PolicyState(1), _signals(queued=4, loads=(8,)), 100.0)
    assert decision == Decision(1)


def test_old_waiting_request_adds_a_replica_even_with_a_short_queue():
    _, decision = decide(POLICY, PolicyState(1), _signals(queued=1, age=2.5, loads=(8,)), 100.0)
    assert decision.desired == 2 and "oldest waiting 2.5 s" in decision.reason


def test_engine_waiting_counts_as_waiting_work():
    signals = FleetSignals(0, 0.0, (ReplicaLoad("m-r0", 8, 6, 8),))
    assert decide(POLICY, PolicyState(1), signals, 100.0)[1].desired == 2


def test_no_second_addition_while_a_replica_starts_or_within_the_cooldown():
    state, decisions = _run(PolicyState(1), [
        (100.0, _signals(queued=20, loads=(8,))),  # -> 2
        (101.0, _signals(queued=20, loads=(8,), starting=1)),  # still starting
        (102.0, _signals(queued=20, loads=(8, 8))),  # serving, but within the 5 s cooldown
        (105.0, _signals(queued=20, loads=(8, 8))),  # -> 3
        (111.0, _signals(queued=20, loads=(8, 8, 8))),  # at the maximum
    ])
    assert [d.desired for d in decisions] == [2, 2, 2, 3, 3]
    assert state.desired == 3


def test_low_load_removes_one_replica_only_after_the_cooldown_and_drains_the_least_loaded():
    state, decisions = _run(PolicyState(2), [
        (100.0, _signals(loads=(3, 1))),  # 4 running <= 0.5 x 8 x 1: low; cooldown starts
        (105.0, _signals(loads=(3, 1))),
        (110.0, _signals(loads=(3, 1))),  # 10 s low -> 1, drain m-r1 (1 running)
    ])
    assert [d.desired for d in decisions] == [2, 2, 1]
    assert decisions[-1].drain_replica_id == "m-r1" and "low load" in decisions[-1].reason
    assert state.low_load_since is None


def test_among_equally_loaded_replicas_the_newest_is_drained():
    _, decisions = _run(PolicyState(3), [(0.0, _signals(loads=(0, 0, 0))), (10.0, _signals(loads=(0, 0, 0)))])
    assert decisions[-1].drain_replica_id == "m-r2"


def test_load_between_the_thresholds_restarts_the_cooldown():
    _, decisions = _run(PolicyState(2), [
        (100.0, _signals(loads=(2, 1))),  # low
        (108.0, _signals(loads=(4, 3))),  # 7 > 4: not low, not pressure: the cooldown restarts
        (109.0, _signals(loads=(2, 1))),  # low again from here
        (118.0, _signals(loads=(2, 1))),  # 9 s: not yet
        (119.0, _signals(loads=(2, 1))),  # 10 s -> 1
    ])
    assert [d.desired for d in decisions] == [2, 2, 2, 2, 1]


def test_waiting_work_is_never_low_load():
    _, decisions = _run(PolicyState(2), [(0.0, _signals(queued=1, loads=(0, 0))),
                                         (100.0, _signals(queued=1, loads=(0, 0)))])
    assert [d.desired for d in decisions] == [2, 2]


def test_never_below_the_minimum_nor_during_a_drain_in_progress():
    _, at_min = _run(PolicyState(1), [(0.0, _signals(loads=(0,))), (100.0, _signals(loads=(0,)))])
    assert [d.desired for d in at_min] == [1, 1]
    # desired 2, but one of the two already drains: no second removal until it is gone
    _, mid_drain = _run(PolicyState(2), [(0.0, _signals(loads=(0, 0, 0), draining=("m-r2",))),
                                         (100.0, _signals(loads=(0, 0, 0), draining=("m-r2",)))])
    assert [d.drain_replica_id for d in mid_drain] == [None, None]


def test_desired_is_brought_within_min_and_max():
    _, decision = decide(POLICY, PolicyState(0), _signals(loads=()), 0.0)
    assert decision.desired == 1 and "kept within" in decision.reason
    _, decision = decide(POLICY, PolicyState(7), _signals(loads=(0,)), 0.0)
    assert decision.desired == 3


def test_scaled_to_zero_the_first_request_adds_a_replica():
    policy = ScalingPolicy(min_replicas=0, max_replicas=2, target_queue_per_replica=8)
    _, decision = decide(policy, PolicyState(0), FleetSignals(1, 0.0, ()), 0.0)
    assert decision.desired == 1


@pytest.mark.parametrize(("changes", "param"), [
    ({"min_replicas": -1}, "min-replicas"), ({"min_replicas": 3, "max_replicas": 2}, "max-replicas"),
    ({"max_replicas": 0, "min_replicas": 0}, "max-replicas"), ({"target_wait_s": -1}, "target-wait-s"),
    ({"scale_down_load": 1.5}, "scale-down-load"),
])
def test_bad_bounds_are_refused_naming_the_flag(changes, param):
    with pytest.raises(InvalidRequestError) as info:
        ScalingPolicy(**{"max_replicas": 2, **changes}).validate()
    assert info.value.param == param
