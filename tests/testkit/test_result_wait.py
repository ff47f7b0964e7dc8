"""testkit/result_wait.py against a real Redis: the schedulers' heartbeat expositions summed,
and the wait's share of wall time between the heartbeats inside a window."""

from __future__ import annotations

import time

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


def test_share_is_the_rise_between_heartbeats_over_their_interval(redis_server) -> None:
    client, keys = redis.Redis.from_url(redis_server.url), Keys()
    client.set(keys.scheduler_metrics("a"), exposition("a", 1.0))
    client.set(keys.scheduler_metrics("b"), exposition("b", 2.0))
    for name in ("a", "b"):  # (the probe finds the schedulers in the registry, as the gateway does)
        registry.beat(client, keys, registry.SCHEDULERS, name, 600)
    with ResultWaitProbe(redis_server.url, poll_s=0.005) as probe:
        time.sleep(0.1)
        start = time.monotonic()
        time.sleep(0.05)
        client.set(keys.scheduler_metrics("a"), exposition("a", 1.1))  # a heartbeat of a
        time.sleep(0.4)
        client.set(keys.scheduler_metrics("b"), exposition("b", 2.2))  # and one of b, 0.4 s later
        time.sleep(0.1)
        end = time.monotonic()
    client.close()
    assert probe.samples[0][1] == 3.0  # both schedulers' totals, the other metric left out
    assert abs(probe.samples[-1][1] - 3.3) < 1e-9
    # from a's heartbeat (3.1) to b's (3.3), ~0.4 s apart: 0.2 s of waiting in 0.4 s
    assert abs(probe.share(start, end) - 0.5) < 0.1
    assert probe.share(end, end + 1) is None  # no heartbeat inside
