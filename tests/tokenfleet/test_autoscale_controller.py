"""The controller and its Redis signals against a real Redis, with a launcher that records
what it is asked to do (the scheduler processes themselves are covered by the fleet tests)."""

from __future__ import annotations

import time

import pytest

from protocol import registry
from protocol.keys import CONSUMER_GROUP, Keys
from tokenfleet.autoscale.controller import AutoscaleController
from tokenfleet.autoscale.launcher import PlacementTimeout
from tokenfleet.autoscale.policy import ScalingPolicy
from tokenfleet.autoscale.signals import read_signals

KEYS = Keys()
MODEL = "m"


class RecordingLauncher:
    """Replicas that 'run' until stopped; a heartbeat appears when the test writes one."""

    def __init__(self, *, placeable: int = 100) -> None:
        self.launched: list[str] = []
        self.alive: set[str] = set()
        self.placeable = placeable
        self.exited: dict[str, int] = {}

    def launch(self, replica_id: str) -> None:
        if len(self.alive) >= self.placeable:
            raise PlacementTimeout(f"Ray could not place replica {replica_id}")
        self.launched.append(replica_id)
        self.alive.add(replica_id)

    def reap(self) -> dict[str, int]:
        exited, self.exited = self.exited, {}
        return exited

    def running(self) -> set[str]:
        return set(self.alive)

    def stop(self, replica_id: str) -> None:
        self.alive.discard(replica_id)

    def close(self) -> None:
        self.alive.clear()


def _beat(client, replica_id: str, running: int = 0, waiting: int = 0, draining: bool = False) -> None:
    client.hset(KEYS.scheduler(replica_id), mapping={"model": MODEL, "num_running": running,
                                                     "num_waiting": waiting, "max_num_seqs": 4,
                                                     "draining": int(draining)})
    registry.beat(client, KEYS, registry.SCHEDULERS, replica_id, 60)


def _queue(client, n: int, *, read: int = 0) -> None:
    stream = KEYS.request_stream(MODEL, "interactive")
    client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    for i in range(n):
        client.xadd(stream, {"m": f"r{i}"})
    if read:
        client.xreadgroup(CONSUMER_GROUP, "s", {stream: ">"}, count=read)


def test_signals_count_unread_entries_and_the_oldest_ones_age(redis_server):
    client = redis_server.client()
    _queue(client, 5, read=2)
    _beat(client, "m-r0", running=2, waiting=1)
    client.hset(KEYS.scheduler("other"), mapping={"model": "another-model", "num_running": 9})
    registry.beat(client, KEYS, registry.SCHEDULERS, "other", 60)
    signals = read_signals(client, KEYS, MODEL, now=time.time() + 10)
    assert signals.num_queued == 3 and signals.num_waiting == 4
    assert 9 < signals.oldest_queued_age_s < 20
    assert [r.replica_id for r in signals.replicas] == ["m-r0"]
    assert read_signals(client, KEYS, "no-such-model").num_queued == 0


def test_controller_grows_on_a_queue_drains_on_low_load_and_publishes_desired_against_actual(redis_server):
    client = redis_server.client()
    launcher = RecordingLauncher()
    policy = ScalingPolicy(min_replicas=1, max_replicas=2, target_queue_per_replica=2, scale_up_cooldown_s=0,
                           scale_down_cooldown_s=5, scale_down_load=1.0)
    controller = AutoscaleController(client, KEYS, MODEL, policy, launcher)
    controller.tick(now=0.0)
    assert launcher.launched == ["m-r0"]
    _beat(client, "m-r0", running=4)
    _queue(client, 5)
    assert controller.tick(now=1.0).desired == 2 and launcher.launched == ["m-r0", "m-r1"]
    assert client.hgetall(KEYS.replicas(MODEL))[b"starting"] == b"1"
    _beat(client, "m-r1", running=4)
    client.delete(KEYS.request_stream(MODEL, "interactive"))
    _beat(client, "m-r0", running=1)
    _beat(client, "m-r1", running=2)
    controller.tick(now=2.0)  # low load from here
    published = {k.decode(): v.decode() for k, v in client.hgetall(KEYS.replicas(MODEL)).items()}
    assert published["desired"] == "2" and published["actual"] == "2" and published["starting"] == "0"
    decision = controller.tick(now=7.0)
    assert decision.desired == 1 and decision.drain_replica_id == "m-r0"  # the less loaded one
    deadline = float(client.get(KEYS.drain("m-r0")))
    assert deadline > time.time()
    published = {k.decode(): v.decode() for k, v in client.hgetall(KEYS.replicas(MODEL)).items()}
    assert published["desired"] == "1" and published["draining"] == "1"
    assert published["last_event"].startswith("scale_down")
    # it drained: its heartbeat went, its process exited 0
    client.delete(KEYS.scheduler("m-r0"))
    launcher.alive.discard("m-r0")
    launcher.exited = {"m-r0": 0}
    controller.tick(now=8.0)
    published = {k.decode(): v.decode() for k, v in client.hgetall(KEYS.replicas(MODEL)).items()}
    assert (published["desired"], published["actual"], published["draining"]) == ("1", "1", "0")
    assert launcher.launched == ["m-r0", "m-r1"]  # nothing relaunched


def test_unplaced_replica_is_reported_and_not_retried_before_the_back_off(redis_server):
    client = redis_server.client()
    launcher = RecordingLauncher(placeable=1)
    policy = ScalingPolicy(min_replicas=1, max_replicas=3, target_queue_per_replica=1, scale_up_cooldown_s=4)
    controller = AutoscaleController(client, KEYS, MODEL, policy, launcher)
    controller.tick(now=0.0)
    _beat(client, "m-r0", running=4)
    _queue(client, 5)
    controller.tick(now=10.0)  # wants 2, Ray cannot place it
    published = {k.decode(): v.decode() for k, v in client.hgetall(KEYS.replicas(MODEL)).items()}
    assert published["unplaced"] == "1" and published["desired"] == "1"
    assert published["last_event"].startswith("replica_unplaced: Ray could not place replica m-r1")
    controller.tick(now=12.0)  # within the back-off: no new request to Ray
    assert client.hget(KEYS.replicas(MODEL), "unplaced") == b"1"
    controller.tick(now=14.5)  # after it: asked again, still unplaced, the back-off doubles
    assert client.hget(KEYS.replicas(MODEL), "unplaced") == b"2"
    assert controller.placement_backoff_s == pytest.approx(8.0)
    assert launcher.launched == ["m-r0"]


def test_a_restarted_controller_adopts_the_replicas_it_finds_and_names_new_ones_apart(redis_server):
    client = redis_server.client()
    _beat(client, "m-r0", running=4)
    _beat(client, "m-r1", running=4)
    launcher = RecordingLauncher()
    policy = ScalingPolicy(min_replicas=1, max_replicas=3, target_queue_per_replica=1, scale_up_cooldown_s=0)
    controller = AutoscaleController(client, KEYS, MODEL, policy, launcher)
    assert controller.tick(now=0.0).desired == 2 and launcher.launched == []
    _queue(client, 5)
    controller.tick(now=1.0)
    assert launcher.launched == ["m-r2"]
