"""Admission against a model's queue depth (`max_queue`) without a Redis round trip per request.

Reading the depth costs two round trips (gateway/serving/store.py, queue_depth): 0.4-0.8 ms of
every request's time to its XADD when each request read it (issue 27). Instead each process
keeps each model's depth as last read, plus what it admitted since that read began (counted
from the read's start: an admission the read may already have seen counts twice, never zero
times). A read older than `refresh_s` is renewed in the background, so under traffic the
estimate is at most that old. What other gateway processes queued since is not seen: the limit
is approximate by up to their share of one refresh. It never refuses on an estimate: a request
that the estimate would refuse reads the depth first (the shared read), and is refused on that
read only; so is one that finds no read younger than `max_age_s` (an idle process).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from shared.logging import get_logger

log = get_logger("tokenfleet.gateway.queue_depth")

REFRESH_S = 0.05  # an estimate's read older than this is renewed in the background
MAX_AGE_S = 1.0  # one older than this is not used: the request waits for a read


class DepthReader(Protocol):
    """Where a model's queue depth is read: the RequestStore (gateway/serving/store.py), which
    sits above this room and is passed in."""

    async def queue_depth(self, model: str) -> int: ...


@dataclass
class _Reading:
    depth: int
    admitted_before: int  # what this process had admitted when the read began
    started_at: float  # time.monotonic() when it began


class QueueDepths:
    def __init__(self, store: DepthReader, *, refresh_s: float = REFRESH_S,
                 max_age_s: float = MAX_AGE_S) -> None:
        self.store = store
        self.refresh_s = refresh_s
        self.max_age_s = max_age_s
        self._readings: dict[str, _Reading] = {}  # model -> its latest read
        self._admitted: dict[str, int] = {}  # model -> requests this process admitted, ever
        self._reads: dict[str, asyncio.Future] = {}  # model -> the read on its way

    async def refusing_depth(self, model: str, num_requests: int, limit: int) -> int | None:
        """None once num_requests more fit under limit (counted as admitted then); else the
        depth, as just read, that has no room for them."""
        depth = self.estimate(model)
        if depth is None or depth + num_requests > limit:
            depth = await self.read(model)
        if depth + num_requests > limit:
            return depth
        self._admitted[model] = self._admitted.get(model, 0) + num_requests
        return None

    def estimate(self, model: str) -> int | None:
        """The last read's depth plus what this process admitted since; None without a read
        younger than max_age_s. Starts a background read once the last is refresh_s old."""
        reading = self._readings.get(model)
        age = time.monotonic() - reading.started_at if reading is not None else None
        if age is None or age > self.refresh_s:
            self._start_read(model)
        if age is None or age > self.max_age_s:
            return None
        return reading.depth + self._admitted.get(model, 0) - reading.admitted_before

    async def read(self, model: str) -> int:
        """The depth as read now; callers that ask while a read is on its way share it."""
        return await asyncio.shield(self._start_read(model))

    def _start_read(self, model: str) -> asyncio.Future:
        pending = self._reads.get(model)
        if pending is None:
            pending = self._reads[model] = asyncio.ensure_future(self._read(model))
            pending.add_done_callback(lambda done: self._read_done(model, done))
        return pending

    async def _read(self, model: str) -> int:
        # (The store shares a read on its way too, the fleet tracker's: one round trip older.)
        reading = _Reading(0, self._admitted.get(model, 0), time.monotonic())
        reading.depth = await self.store.queue_depth(model)
        self._readings[model] = reading
        return reading.depth

    def _read_done(self, model: str, done: asyncio.Future) -> None:
        if self._reads.get(model) is done:
            del self._reads[model]
        if not done.cancelled() and done.exception() is not None:  # retrieved: its callers may have left
            log.debug("queue_depth_read_failed", model=model, error=repr(done.exception()))

    async def close(self) -> None:
        for pending in list(self._reads.values()):
            pending.cancel()
        await asyncio.gather(*list(self._reads.values()), return_exceptions=True)


# The app's key of this process's one QueueDepths (opened in gateway/http/app.py's cleanup_ctx).
QUEUE_DEPTHS = web.AppKey("queue_depths", QueueDepths)  # admission against max_queue
