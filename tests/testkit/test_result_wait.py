"""testkit/result_wait.py against a real Redis: the schedulers' heartbeat expositions summed,
and the wait's share of wall time between the heartbeats inside a window."""

from __future__ import annotations

import time

import pytest
import redis

from protocol import registry
from protocol.keys import Keys
from testkit.result_wait import ResultWaitProbe


def exposition(scheduler: str, waited_s: float) -> bytes:
    labels = f'{{model_name="m",scheduler="{scheduler}"}}'
    return (f"# HELP tokenfleet:engine_result_wait_seconds_total blocked on results\n"
            f"# TYPE tokenfleet:engine_result_wait_seconds_total counter\n"
            f"tokenfleet:engine_result_wait_seconds_total{labels} {waited_s}\n"
            f"tokenfleet:generation_tokens_total{labels} 99.0\n").encode()


def _wait_for_total(probe: ResultWaitProbe, total: float) -> None:
    """Until the probe has noted a heartbeat with this total (its thread may start or poll late
    on a loaded machine)."""
    deadline = time.monotonic() + 30
    while not (probe.samples and abs(probe.samples[-1][1] - total) < 1e-9):
        assert time.monotonic() < deadline, (total, probe.samples)
        time.sleep(0.005)


def test_share_is_the_rise_between_heartbeats_over_their_interval(redis_server) -> None:
    client, keys = redis.Redis.from_url(redis_server.url), Keys()
    client.set(keys.scheduler_metrics("a"), exposition("a", 1.0))
    client.set(keys.scheduler_metrics("b"), exposition("b", 2.0))
    for name in ("a", "b"):  # (the probe finds the schedulers in the registry, as the gateway does)
        registry.beat(client, keys, registry.SCHEDULERS, name, 600)
    with ResultWaitProbe(redis_server.url, poll_s=0.005) as probe:
        _wait_for_total(probe, 3.0)
        start = time.monotonic()
        client.set(keys.scheduler_metrics("a"), exposition("a", 1.1))  # a heartbeat of a
        _wait_for_total(probe, 3.1)
        time.sleep(0.4)  # (heartbeats at least 0.4 s apart, however late the probe saw them)
        client.set(keys.scheduler_metrics("b"), exposition("b", 2.2))  # and one of b
        _wait_for_total(probe, 3.3)
        end = time.monotonic()
    client.close()
    assert probe.samples[0][1] == 3.0  # both schedulers' totals, the other metric left out
    assert abs(probe.samples[-1][1] - 3.3) < 1e-9
    # From a's heartbeat (3.1) to b's (3.3), when the probe saw each: 0.2 s of waiting over the
    # time between them (0.4 s unloaded, so 0.5; more on a loaded machine, so less), the
    # heartbeat before the window (3.0) left out.
    [(seen_a, _)] = [s for s in probe.samples if abs(s[1] - 3.1) < 1e-9]
    [(seen_b, _)] = [s for s in probe.samples if abs(s[1] - 3.3) < 1e-9]
    assert seen_b - seen_a >= 0.4
    assert probe.share(start, end) == pytest.approx(0.2 / (seen_b - seen_a))
    assert probe.share(end, end + 1) is None  # no heartbeat inside
