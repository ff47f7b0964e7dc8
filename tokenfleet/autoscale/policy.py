"""When to add or remove a replica, as a pure function of what the fleet reports.

Up: waiting work per replica, or the age of the oldest waiting request, passes its target.
One replica at a time, and not while one is still starting (it will take work soon).
Down: no work waits and what runs fits in one replica fewer at `scale_down_load` of its slots,
without a break for `scale_down_cooldown_s`. Between the two thresholds nothing changes, and a
moment of pressure restarts the cooldown: that band is the hysteresis that stops flapping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from shared.errors import InvalidRequestError


@dataclass(frozen=True)
class ScalingPolicy:
    min_replicas: int = 1
    max_replicas: int = 1
    target_queue_per_replica: float = 8.0  # waiting requests per serving replica before adding one
    target_wait_s: float = 5.0  # the oldest waiting request older than this: add one
    scale_down_load: float = 0.5  # fraction of one-fewer replicas' slots the running work must fit in
    scale_up_cooldown_s: float = 5.0  # at least this long between two additions
    scale_down_cooldown_s: float = 60.0  # low load for this long before one replica is removed

    def validate(self) -> ScalingPolicy:
        if self.min_replicas < 0:
            raise InvalidRequestError(f"--min-replicas must be >= 0, got {self.min_replicas}",
                                      param="min-replicas")
        if self.max_replicas < max(1, self.min_replicas):
            raise InvalidRequestError(
                f"--max-replicas must be >= max(1, --min-replicas), got {self.max_replicas} "
                f"with --min-replicas {self.min_replicas}", param="max-replicas")
        for name in ("target_queue_per_replica", "target_wait_s", "scale_up_cooldown_s",
                     "scale_down_cooldown_s"):
            if getattr(self, name) < 0:
                flag = name.replace("_", "-")
                raise InvalidRequestError(f"--{flag} must be >= 0, got {getattr(self, name)}", param=flag)
        if not 0 <= self.scale_down_load <= 1:
            raise InvalidRequestError(f"--scale-down-load must be within [0, 1], got {self.scale_down_load}",
                                      param="scale-down-load")
        return self


@dataclass(frozen=True)
class ReplicaLoad:
    """One scheduler, from its heartbeat."""

    replica_id: str
    num_running: int
    num_waiting: int  # admitted, waiting inside the engine (slots or KV blocks short)
    max_num_seqs: int
    is_draining: bool = False

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting


@dataclass(frozen=True)
class FleetSignals:
    num_queued: int  # stream entries no scheduler has read yet
    oldest_queued_age_s: float  # of the oldest of them; 0 when none
    replicas: tuple[ReplicaLoad, ...]  # live heartbeats, draining ones included
    num_starting: int = 0  # launched replicas that have not sent a heartbeat yet

    @property
    def serving(self) -> list[ReplicaLoad]:
        return [r for r in self.replicas if not r.is_draining]

    @property
    def num_waiting(self) -> int:
        return self.num_queued + sum(r.num_waiting for r in self.serving)


@dataclass(frozen=True)
class PolicyState:
    desired: int
    low_load_since: float | None = None
    last_scale_up_at: float = -math.inf


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str = ""  # why desired changed; "" when it did not
    drain_replica_id: str | None = None  # the replica to drain for a scale-down


def decide(policy: ScalingPolicy, state: PolicyState, signals: FleetSignals,
           now: float) -> tuple[PolicyState, Decision]:
    """The next state and what to do, from the signals seen at `now` (monotonic seconds)."""
    serving = signals.serving
    desired = min(max(state.desired, policy.min_replicas), policy.max_replicas)
    if desired != state.desired:
        state = replace(state, desired=desired)
        return state, Decision(desired, f"kept within [{policy.min_replicas}, {policy.max_replicas}]")
    num_replicas = len(serving) + signals.num_starting
    waiting = signals.num_waiting
    is_queue_over = (waiting > policy.target_queue_per_replica * max(1, num_replicas)
                     or (num_replicas == 0 and waiting > 0))  # scaled to zero: the first request wakes one
    is_wait_over = signals.oldest_queued_age_s > policy.target_wait_s
    if is_queue_over or is_wait_over:
        state = replace(state, low_load_since=None)
        can_add = (desired < policy.max_replicas and signals.num_starting == 0
                   and num_replicas >= desired and now - state.last_scale_up_at >= policy.scale_up_cooldown_s)
        if not can_add:
            return state, Decision(desired)
        reason = (f"{waiting} waiting > {policy.target_queue_per_replica:g} per replica "
                  f"x {max(1, num_replicas)}"
                  if is_queue_over else
                  f"oldest waiting {signals.oldest_queued_age_s:.1f} s > {policy.target_wait_s:g} s")
        state = replace(state, desired=desired + 1, last_scale_up_at=now)
        return state, Decision(desired + 1, reason)
    is_changing = signals.num_starting or len(serving) != len(signals.replicas)  # one at a time
    if not _is_low_load(policy, signals) or desired <= policy.min_replicas or len(serving) != desired \
            or is_changing:
        return replace(state, low_load_since=None), Decision(desired)
    if state.low_load_since is None:
        return replace(state, low_load_since=now), Decision(desired)
    if now - state.low_load_since < policy.scale_down_cooldown_s:
        return state, Decision(desired)
    # The least loaded replica finishes soonest; among equals, the newest (highest id) goes.
    victim = min(sorted(serving, key=lambda r: r.replica_id, reverse=True), key=lambda r: r.load)
    state = replace(state, desired=desired - 1, low_load_since=None)
    running = sum(r.load for r in serving)
    return state, Decision(desired - 1, f"low load for {policy.scale_down_cooldown_s:g} s "
                                        f"({running} running on {len(serving)})", victim.replica_id)


def _is_low_load(policy: ScalingPolicy, signals: FleetSignals) -> bool:
    """Nothing waits, and what runs would fit in one replica fewer at scale_down_load of its slots."""
    serving = signals.serving
    if signals.num_waiting or len(serving) < 1:
        return False
    slots_per_replica = sum(r.max_num_seqs for r in serving) / len(serving)
    return sum(r.load for r in serving) <= policy.scale_down_load * slots_per_replica * (len(serving) - 1)
