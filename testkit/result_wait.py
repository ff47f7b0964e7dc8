"""The share of wall time a fleet's engine threads wait on the GPU, from their own timer: the
`tokenfleet:engine_result_wait_seconds_total` counter each scheduler writes to Redis with its
heartbeat (service/telemetry.py). py-spy can say the same, but a blocking sampler pauses the host
while the GPU runs on (the wait it sees shrinks), and a nonblocking one can lose samples.

A thread polls the schedulers' metric keys and notes each new heartbeat's total with the time
it appeared; the share over a window is the counter's rise between the first and the last
heartbeat inside it, over the time between them."""

from __future__ import annotations

import threading
import time

import redis
from prometheus_client.parser import text_string_to_metric_families

from protocol import registry
from protocol.keys import Keys

COUNTER = "tokenfleet:engine_result_wait_seconds_total"


def total_wait(texts: list[bytes]) -> float:
    """The counter summed over the schedulers' expositions."""
    total = 0.0
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            total += sum(s.value for s in family.samples if s.name == COUNTER)
    return total


class ResultWaitProbe:
    def __init__(self, redis_url: str, poll_s: float = 0.01) -> None:
        self.client = redis.Redis.from_url(redis_url)
        self.poll_s = poll_s
        self.samples: list[tuple[float, float]] = []  # (time.monotonic() it appeared, total wait)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="result-wait-probe", daemon=True)

    def __enter__(self) -> ResultWaitProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()

    def _run(self) -> None:
        keys, last = Keys(), None
        while not self._stop.wait(self.poll_s):
            names = sorted(registry.live_members(self.client, keys)[registry.SCHEDULERS])
            metrics = [keys.scheduler_metrics(n) for n in names]
            texts = [t for t in self.client.mget(metrics) if t] if names else []
            if texts and texts != last:
                self.samples.append((time.monotonic(), total_wait(texts)))
                last = texts

    def share(self, start: float, end: float) -> float | None:
        """The wait's share of wall time between two time.monotonic() times (None: fewer than
        two heartbeats fell inside)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2 or inside[-1][0] == inside[0][0]:
            return None
        (t0, w0), (t1, w1) = inside[0], inside[-1]
        return (w1 - w0) / (t1 - t0)
