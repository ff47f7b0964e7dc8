"""The queue-time histogram (a scheduler's started_at minus queued_at, both in tf:res) of
finished calls, read in bulk: the calls' ids wait here and one pipeline reads them all, at
each /metrics scrape and every FLUSH_S, instead of one Redis command (and one task) per
call (redis-py spends ~0.1 ms of CPU per command here)."""

from __future__ import annotations

import asyncio
from typing import Protocol

from aiohttp import web
from redis.exceptions import RedisError

from gateway.core.metrics import GatewayMetrics
from shared.logging import get_logger

FLUSH_S = 2.0
MAX_PENDING = 512  # a flush starts early past this many waiting ids

log = get_logger("tokenfleet.gateway.queue_times")


class TimingReader(Protocol):
    """Where the calls' timings are read: the RequestStore (gateway/serving/store.py), which sits
    above this room and is passed in."""

    async def timings(self, req_ids: list[str]) -> list[tuple[float | None, float | None]]: ...


class QueueTimes:
    def __init__(self, store: TimingReader, metrics: GatewayMetrics) -> None:
        self.store = store
        self.metrics = metrics
        self._pending: list[tuple[str, str]] = []  # (model, req_id) of calls that ended
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # one flush at a time: each id is read and observed once

    def add(self, model: str, req_ids: list[str]) -> None:
        self._pending += [(model, req_id) for req_id in req_ids]
        if len(self._pending) >= MAX_PENDING:
            self._wake.set()

    async def flush(self) -> None:
        async with self._lock:
            pending, self._pending = self._pending, []
            if not pending:
                return
            try:
                rows = await self.store.timings([req_id for _, req_id in pending])
            except (RedisError, OSError) as exc:
                log.warning("queue_times_unread", num_requests=len(pending), error=str(exc))
                return
            for (model, _), (queued_at, started_at) in zip(pending, rows, strict=True):
                if queued_at is not None and started_at is not None:
                    self.metrics.queue_time.labels(model).observe(max(0.0, started_at - queued_at))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(self._wake.wait(), FLUSH_S)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            await self.flush()


# The app's key of this process's one QueueTimes (opened in gateway/http/app.py's cleanup_ctx).
QUEUE_TIMES = web.AppKey("queue_times", QueueTimes)
