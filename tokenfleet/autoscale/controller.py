"""The autoscaler's loop for one model: read the signals, decide, launch or drain, publish.

Every `interval_s`:
  1. reap replicas whose process ended (a drained one, or a crash) and release their groups;
  2. read the queue and the heartbeats (signals.py) and decide (policy.py);
  3. reconcile: launch replicas until serving + starting reaches `desired` (a placement that
     times out is reported and the decision taken back, with the scale-up cooldown as the
     back-off); for a scale-down, set the chosen scheduler's drain key: it stops reading,
     finishes its requests, removes its heartbeat and exits, and step 1 releases it;
  4. write tf:replicas:{model} (desired against actual) for `tokenfleet status` and metrics.

Only Redis carries the drain, so the controller may run on any machine of the cluster.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import replace

import redis

from protocol.keys import Keys
from shared.logging import get_logger
from tokenfleet.autoscale.launcher import PlacementTimeout, ReplicaLauncher
from tokenfleet.autoscale.policy import Decision, FleetSignals, PolicyState, ScalingPolicy, decide
from tokenfleet.autoscale.signals import read_signals

STARTUP_TIMEOUT_S = 600.0  # a launched replica with no heartbeat after this is stopped
MAX_PLACEMENT_BACKOFF_S = 300.0  # the longest wait before asking Ray again after a placement timed out


class AutoscaleController:
    def __init__(self, client: redis.Redis, keys: Keys, model_name: str, policy: ScalingPolicy,
                 launcher: ReplicaLauncher, *, interval_s: float = 1.0,
                 drain_timeout_s: float = 300.0) -> None:
        self.client = client
        self.keys = keys
        self.model_name = model_name
        self.policy = policy.validate()
        self.launcher = launcher
        self.interval_s = interval_s
        self.drain_timeout_s = drain_timeout_s
        # Made at the first tick from the replicas serving then: a restarted controller adopts them.
        self.state: PolicyState | None = None
        self.started_at: dict[str, float] = {}  # replica_id -> launch time, until its first heartbeat
        self.draining: dict[str, float] = {}  # replica_id -> when its drain was asked for
        self.num_unplaced = 0
        self.next_launch_at = 0.0  # monotonic; later after placements that timed out
        self.placement_backoff_s = 0.0
        self.last_event, self.last_event_at = "", 0.0
        self._ids = itertools.count()
        self.log = get_logger("tokenfleet.autoscale", model=model_name)

    def run(self, stop: threading.Event) -> None:
        self.log.info("autoscaler_started", min_replicas=self.policy.min_replicas,
                      max_replicas=self.policy.max_replicas)
        while not stop.is_set():
            try:
                self.tick()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self.log.warning("redis_unreachable", error=str(exc))
            stop.wait(self.interval_s)

    def tick(self, now: float | None = None) -> Decision:
        now = time.monotonic() if now is None else now
        self._reap()
        signals = read_signals(self.client, self.keys, self.model_name)
        live = {r.replica_id for r in signals.replicas}
        self._check_starting(live, now)
        for replica_id in [r for r in self.draining if r not in live and r not in self.launcher.running()]:
            del self.draining[replica_id]  # drained a scheduler some other launcher started
        signals = replace(signals, num_starting=len(self.started_at))
        if self.state is None:
            self.state = PolicyState(desired=max(self.policy.min_replicas, len(signals.serving)))
        self.state, decision = decide(self.policy, self.state, signals, now)
        if decision.reason:
            self._event("scale_up" if decision.drain_replica_id is None else "scale_down",
                        decision.reason, now, desired=decision.desired, replica=decision.drain_replica_id)
        if decision.drain_replica_id is not None:
            self._drain(decision.drain_replica_id)
        self._launch_missing(signals, now)
        self._publish(signals)
        return decision

    # -- replicas -------------------------------------------------------------------------

    def _reap(self) -> None:
        for replica_id, code in self.launcher.reap().items():
            was_draining = self.draining.pop(replica_id, None) is not None
            self.started_at.pop(replica_id, None)
            if was_draining and code == 0:
                self.log.info("replica_drained", replica=replica_id)
            else:  # the policy sees one fewer and launches a successor if it is still wanted
                self.log.warning("replica_exited", replica=replica_id, code=code, was_draining=was_draining)

    def _check_starting(self, live: set[str], now: float) -> None:
        for replica_id, started in list(self.started_at.items()):
            if replica_id in live:
                del self.started_at[replica_id]
                self.log.info("replica_serving", replica=replica_id, startup_s=round(now - started, 1))
            elif now - started > STARTUP_TIMEOUT_S:
                self.log.error("replica_never_served", replica=replica_id, after_s=STARTUP_TIMEOUT_S)
                del self.started_at[replica_id]
                self.launcher.stop(replica_id)

    def _launch_missing(self, signals: FleetSignals, now: float) -> None:
        num_serving = len(signals.serving) + len(self.started_at) - self._num_draining_not_reported(signals)
        while num_serving < self.state.desired and now >= self.next_launch_at:
            replica_id = self._new_replica_id(signals)
            try:
                self.launcher.launch(replica_id)
            except PlacementTimeout as exc:
                # Reported, not retried at once: a scale-up is taken back (the minimum stays
                # wanted), and Ray is asked again only after a back-off that doubles each time.
                self.num_unplaced += 1
                backoff = max(1.0, self.policy.scale_up_cooldown_s, 2 * self.placement_backoff_s)
                self.placement_backoff_s = min(MAX_PLACEMENT_BACKOFF_S, backoff)
                self.next_launch_at = now + self.placement_backoff_s
                self.state = replace(self.state, desired=max(num_serving, self.policy.min_replicas),
                                     last_scale_up_at=now)
                self._event("replica_unplaced", exc.message, now, replica=replica_id,
                            retry_in_s=self.placement_backoff_s)
                return
            self.placement_backoff_s = 0.0
            self.started_at[replica_id] = now
            num_serving += 1

    def _num_draining_not_reported(self, signals: FleetSignals) -> int:
        """Replicas asked to drain whose heartbeat does not say so yet (they still look serving)."""
        return sum(1 for r in signals.serving if r.replica_id in self.draining)

    def _new_replica_id(self, signals: FleetSignals) -> str:
        taken = {r.replica_id for r in signals.replicas} | self.launcher.running()
        while (replica_id := f"{self.model_name}-r{next(self._ids)}") in taken:
            pass
        return replica_id

    def _drain(self, replica_id: str) -> None:
        deadline = time.time() + self.drain_timeout_s
        self.client.set(self.keys.drain(replica_id), repr(deadline), ex=int(self.drain_timeout_s) + 60)
        self.draining[replica_id] = time.monotonic()

    # -- visibility -----------------------------------------------------------------------

    def _event(self, event: str, reason: str, now: float, **fields) -> None:
        self.last_event, self.last_event_at = f"{event}: {reason}", time.time()
        # At warning level: `tokenfleet up` logs warnings and above by default, and a change in the
        # fleet's size is what an operator reading that log wants to see.
        self.log.warning(event, reason=reason, **{k: v for k, v in fields.items() if v is not None})

    def _publish(self, signals: FleetSignals) -> None:
        self.client.hset(self.keys.replicas(self.model_name), mapping={
            "desired": self.state.desired if self.state else self.policy.min_replicas,
            "actual": len(signals.serving) - self._num_draining_not_reported(signals),
            "starting": len(self.started_at), "draining": len(self.draining),
            "min": self.policy.min_replicas, "max": self.policy.max_replicas,
            "queued": signals.num_queued, "oldest_queued_age_s": round(signals.oldest_queued_age_s, 3),
            "unplaced": self.num_unplaced, "last_event": self.last_event, "last_event_at": self.last_event_at,
            "updated_at": time.time(),
        })

    def close(self) -> None:
        self.launcher.close()
        self.client.hset(self.keys.replicas(self.model_name), mapping={"actual": 0, "starting": 0,
                                                                       "updated_at": time.time()})
