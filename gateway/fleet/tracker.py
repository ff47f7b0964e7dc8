"""What the gateway knows of the fleet: which schedulers are alive (the schedulers' registry,
protocol/registry.py, and their `tf:sched:{id}` heartbeats) and how deep each fronted model's
queue is. Refreshed in the background; a model that looks unserved is re-checked once before a
503. A refresh costs the same however many keys Redis holds: it reads the registry, never
scans the keyspace, and calls that arrive while one runs share it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from aiohttp import web

from gateway.core.metrics import GatewayMetrics
from gateway.core.tasks import every
from gateway.errors import Unavailable
from gateway.fleet.queue_depth import DepthReader
from gateway.fleet.routing import PrefixRouter, ReplicaView
from protocol import registry
from protocol.keys import CONSUMER_GROUP, Keys
from protocol.prefix_hash import SUMMARY_HASH_BYTES
from shared.logging import get_logger

log = get_logger("tokenfleet.gateway.fleet")


@dataclass
class SchedulerInfo:
    scheduler_id: str
    model: str
    num_running: int
    num_waiting: int
    kv_usage: float
    max_num_seqs: int
    updated_at: float
    # For routing by prefix (gateway/fleet/routing.py) and the fleet's prefix-cache hit rate.
    block_size: int = 16
    prefix_summary_depth: int = 0
    draining: bool = False
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    max_lora_rank: int = 0  # the largest LoRA adapter rank it serves; 0: it serves none
    loras_loaded: frozenset[str] = frozenset()  # the LoRA adapters in its device slots
    prefix_summary_gpu_hashes: int = -1  # its summary's GPU hashes, before its host tier's; -1: all
    runner: str = "generate"  # "pooling": it serves /v1/embeddings only

    @classmethod
    def parse(cls, scheduler_id: str, raw: dict[bytes, bytes]) -> SchedulerInfo | None:
        try:
            return cls(scheduler_id, raw[b"model"].decode(), int(raw.get(b"num_running", 0)),
                       int(raw.get(b"num_waiting", 0)), float(raw.get(b"kv_usage", 0.0)),
                       int(raw.get(b"max_num_seqs", 0)), float(raw.get(b"updated_at", 0.0)),
                       int(raw.get(b"block_size", 16)), int(raw.get(b"prefix_summary_depth", 0)),
                       raw.get(b"draining", b"0") == b"1", int(raw.get(b"prefix_cache_queries", 0)),
                       int(raw.get(b"prefix_cache_hits", 0)), int(raw.get(b"max_lora_rank", 0)),
                       frozenset(json.loads(raw.get(b"loras_loaded", b"[]"))),
                       int(raw.get(b"prefix_summary_gpu_hashes", -1)),
                       raw.get(b"runner", b"generate").decode())
        except (KeyError, ValueError, TypeError):
            return None  # a half-written or foreign hash: not a scheduler we understand


class FleetTracker:
    """Which schedulers are alive and each fronted model's queue depth, as the gateway last read them."""

    def __init__(self, client: aioredis.Redis, keys: Keys, store: DepthReader, metrics: GatewayMetrics,
                 model_names: list[str], *, grace_s: float, refresh_s: float,
                 router: PrefixRouter | None = None) -> None:
        self.router = router  # None: every request goes to the shared streams
        self.client = client
        self.keys = keys
        self.store = store
        self.metrics = metrics
        self.model_names = model_names
        self.grace_s = grace_s
        self.refresh_s = refresh_s
        self.schedulers: dict[str, SchedulerInfo] = {}  # scheduler id -> last heartbeat
        self._last_seen: dict[str, float] = {}  # model -> monotonic time a heartbeat was last seen
        self.queue_depths: dict[str, int] = {}  # fronted model -> entries not yet taken
        self._refreshing: asyncio.Future | None = None  # the refresh in flight, shared by callers

    async def refresh(self) -> None:
        """Read the fleet anew. A call made while a refresh runs waits it out, then shares the
        next one with the other callers that waited: one refresh at a time however many /ready
        arrive, and each caller sees a state read after it called."""
        if self._refreshing is not None and not self._refreshing.done():
            with contextlib.suppress(Exception):  # (its error is its own callers')
                await asyncio.shield(self._refreshing)
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._refresh())
        await asyncio.shield(self._refreshing)

    async def _refresh(self) -> None:
        heartbeats = (await registry.read_live_async(self.client, self.keys, [registry.SCHEDULERS]))
        schedulers = {}
        for scheduler_id, raw in heartbeats[registry.SCHEDULERS].items():
            info = SchedulerInfo.parse(scheduler_id, raw)
            if info is not None:
                schedulers[info.scheduler_id] = info
        self.schedulers = schedulers
        now = time.monotonic()
        for info in schedulers.values():
            self._last_seen[info.model] = now
        for model in self.model_names:
            live = sum(1 for s in schedulers.values() if s.model == model)
            self.metrics.live_schedulers.labels(model).set(live)
            self.queue_depths[model] = await self.store.queue_depth(model)
            self.metrics.queue_depth.labels(model).set(self.queue_depths[model])
            serving = [s for s in schedulers.values() if s.model == model]
            queries = sum(s.prefix_cache_queries for s in serving)
            self.metrics.prefix_cache_hit_rate.labels(model).set(
                sum(s.prefix_cache_hits for s in serving) / queries if queries else 0.0)
            if self.router is not None:
                self.router.update(model, await self._replica_views(model, serving))

    async def _replica_views(self, model: str, serving: list[SchedulerInfo]) -> list[ReplicaView]:
        """What routing needs of each replica: its prefix summary and its own stream's backlog."""
        if len(serving) < 2:
            return []  # one replica: nothing to choose, every request goes to the shared stream
        pipe = self.client.pipeline(transaction=False)
        for info in serving:
            stream = self.keys.replica_stream(model, info.scheduler_id)
            pipe.get(self.keys.prefix_summary(info.scheduler_id))
            pipe.xlen(stream)
            pipe.xpending(stream, CONSUMER_GROUP)
        replies = await pipe.execute(raise_on_error=False)
        views = []
        for info, (summary, length, pending) in zip(serving, zip(*[iter(replies)] * 3, strict=True),
                                                     strict=True):
            summary = summary if isinstance(summary, bytes) else b""
            taken = int(pending["pending"]) if isinstance(pending, dict) else 0
            backlog = max(0, int(length) - taken) if isinstance(length, int) else 0
            hashes = [summary[i:i + SUMMARY_HASH_BYTES] for i in range(0, len(summary), SUMMARY_HASH_BYTES)]
            num_gpu = info.prefix_summary_gpu_hashes if info.prefix_summary_gpu_hashes >= 0 else len(hashes)
            views.append(ReplicaView(info.scheduler_id, info.block_size, info.prefix_summary_depth,
                                     frozenset(hashes[:num_gpu]), info.num_running, info.num_waiting,
                                     info.max_num_seqs, backlog, info.draining, info.loras_loaded,
                                     host_prefixes=frozenset(hashes[num_gpu:])))
        return views

    def runners_of(self, model: str) -> set[str]:
        """The runners ("generate", "pooling") of the model's live schedulers."""
        return {s.runner for s in self.schedulers.values() if s.model == model}

    def is_served(self, model: str) -> bool:
        seen = self._last_seen.get(model)
        return seen is not None and time.monotonic() - seen <= self.grace_s

    @property
    def served_models(self) -> list[str]:
        return [m for m in self.model_names if self.is_served(m)]

    async def require(self, model: str) -> None:
        """503 unless a live scheduler serves the model (re-read once before saying so)."""
        if self.is_served(model):
            return
        await self.refresh()
        if not self.is_served(model):
            raise Unavailable(f"no scheduler serves the model {model!r} right now", param="model",
                              code="no_scheduler", headers={"Retry-After": "5"})

    async def run(self, stop: asyncio.Event) -> None:
        """Refresh every refresh_s until stop is set."""
        await every(self.refresh_s, stop, self.refresh, "fleet_refresh_failed")


# The app's key of this process's one FleetTracker (opened in gateway/http/app.py's cleanup_ctx).
FLEET = web.AppKey("fleet", FleetTracker)
