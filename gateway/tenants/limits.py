"""A tenant's limits, enforced in Redis so that every gateway process shares the counters.

- requests and tokens per minute: `limits`' sliding-window counters in Redis (two counters
  per window, whatever the cost, so a token budget costs no more than a request budget). A
  call is charged its prompts and max_tokens; a chat call without max_tokens is charged an
  estimate instead of the rest of the context window, and settled on what it used when it
  ends (`settle`: the difference charged or refunded);
- concurrent requests: leases, one member per request in the sorted set
  `tf:tenant:{name}:leases`, scored by when the lease lapses. A lease is taken before the
  request is queued, for `pending_lease_s` (a gateway that dies before queueing loses only
  that long); queueing it makes it last `lease_s`. It ends when the request ends: the
  scheduler's terminal write removes it (service/result_store.py), whoever's client
  waited, left or never waited; the gateway removes it at once when it cancels a request
  nobody has claimed, or when its own client leaves. A lease nobody ended lapses. The set's
  TTL is kept past its latest lease wherever a lease is taken or renewed (the scripts
  acquire_leases and extend_leases), so the set never expires with a lease in it.

Over a limit: 429 with Retry-After, and the limit's name as the error's code.
"""

from __future__ import annotations

import asyncio
import math
import time

import redis.asyncio as aioredis
from aiohttp import web
from limits import RateLimitItemPerMinute
from limits.aio.storage import RedisClusterStorage, RedisStorage
from limits.aio.strategies import SlidingWindowCounterRateLimiter
from redis.exceptions import RedisError

from gateway.errors import BadRequest, RateLimited
from gateway.tenants.directory import Tenant
from protocol import lua
from protocol.keys import Keys
from shared.logging import get_logger
from shared.redis_client import cluster_nodes, cluster_options, is_cluster_url

# A call without max_tokens is charged this many output tokens per choice when admitted (or
# fewer: the rest of its context window), then settled on what it used when it ends.
OUTPUT_ESTIMATE_TOKENS = 256
_UNCAPPED = 2**62  # a settlement's limit: it is owed whatever the window holds
_ACQUIRE = lua.Script("acquire_leases")  # (its keys and arguments: protocol/lua/acquire_leases.lua)
log = get_logger("tokenfleet.gateway.limits")
Window = tuple[str, RateLimitItemPerMinute, int]  # (the limit's name, its window, what this call costs)


class TenantLimiter:
    def __init__(self, client: aioredis.Redis, keys: Keys, *, lease_s: float, pending_lease_s: float,
                 retry_after_s: int, redis_url: str | None = None) -> None:
        self.client = client
        self.keys = keys
        self.lease_s = lease_s
        self.pending_lease_s = pending_lease_s
        self.retry_after_s = retry_after_s
        self._storage = _window_storage(client, keys, redis_url)
        self._windows = SlidingWindowCounterRateLimiter(self._storage)

    async def admit(self, tenant: Tenant, req_ids: list[str], num_tokens: int) -> None:
        """Take the tenant's quota for these requests (one per choice) and their `num_tokens`
        (prompts + max_tokens), or raise 429 naming the limit that is reached. Two round trips
        whatever the limits: the leases with the windows' tests, then the windows' charges."""
        limits = tenant.limits
        if limits.tokens_per_minute is not None and num_tokens > limits.tokens_per_minute:
            raise BadRequest(f"this call needs {num_tokens} tokens (prompt + max_tokens), more than tenant "
                             f"{tenant.name!r} may use in a minute ({limits.tokens_per_minute}); give a "
                             "smaller max_tokens", param="max_tokens", code="tokens_per_minute")
        wanted = (("requests_per_minute", limits.requests_per_minute, len(req_ids)),
                  ("tokens_per_minute", limits.tokens_per_minute, num_tokens))
        windows = [(name, RateLimitItemPerMinute(amount), cost) for name, amount, cost in wanted
                   if amount is not None]
        taking = asyncio.ensure_future(self._take_leases(tenant, req_ids))
        try:
            refused = None
            try:
                await self._test_windows(tenant, windows)
            except RateLimited as exc:
                refused = exc
            await taking  # (its refusal is the one told, as when the leases came first)
            if refused is not None:
                raise refused
            await self._charge_windows(tenant, windows)
        except BaseException:
            await asyncio.wait([taking])  # (never cancelled: it may have taken them already)
            if not taking.cancelled() and taking.exception() is None:
                await asyncio.shield(self.release(tenant.name, req_ids))
            raise

    async def _take_leases(self, tenant: Tenant, req_ids: list[str]) -> None:
        cap = tenant.limits.max_concurrent_requests
        if cap is None:
            return
        now = time.time()
        held = await _ACQUIRE.run_async(self.client, [self.keys.tenant_leases(tenant.name)],
                                        [now, now + self.pending_lease_s, cap, *req_ids])
        if held >= 0:
            raise RateLimited(f"tenant {tenant.name!r} has {held} requests in flight; its limit "
                              f"max_concurrent_requests is {cap}", code="max_concurrent_requests",
                              headers={"Retry-After": str(self.retry_after_s)})

    async def _test_windows(self, tenant: Tenant, windows: list[Window]) -> None:
        # Every window is tested before any is charged: a call refused for its tokens does not use
        # up a request. (Two gateways may both pass the test; the charge itself is checked again.)
        passed = await asyncio.gather(*(self._windows.test(item, tenant.name, name, cost=cost)
                                        for name, item, cost in windows))
        for (name, item, _), ok in zip(windows, passed, strict=True):
            if not ok:
                await self._refuse(tenant, name, item)

    async def _charge_windows(self, tenant: Tenant, windows: list[Window]) -> None:
        """Every window charged at once. (A charge refused in a race with another gateway leaves
        the others charged, as one refused after the others were did.)"""
        charged = await asyncio.gather(*(self._windows.hit(item, tenant.name, name, cost=cost)
                                         for name, item, cost in windows))
        for (name, item, _), ok in zip(windows, charged, strict=True):
            if not ok:
                await self._refuse(tenant, name, item)

    async def _refuse(self, tenant: Tenant, name: str, item: RateLimitItemPerMinute) -> None:
        stats = await self._windows.get_window_stats(item, tenant.name, name)
        retry_after = max(1, math.ceil(stats.reset_time - time.time()))
        raise RateLimited(f"tenant {tenant.name!r} reached its limit {name} ({item.amount} per minute); "
                          f"retry in {retry_after} s", code=name, headers={"Retry-After": str(retry_after)})

    async def settle(self, tenant: Tenant, extra_tokens: int) -> None:
        """Charge `extra_tokens` more to the tenant's tokens_per_minute (fewer when negative: a
        refund), whatever the window holds: a call admitted on an estimate, settled on what it
        used. Best effort: a Redis that fails here leaves the estimate charged."""
        per_minute = tenant.limits.tokens_per_minute
        if per_minute is None or extra_tokens == 0:
            return
        item = RateLimitItemPerMinute(per_minute)
        try:
            await self._storage.acquire_sliding_window_entry(
                item.key_for(tenant.name, "tokens_per_minute"), _UNCAPPED, item.get_expiry(), extra_tokens)
        except RedisError as exc:
            log.warning("tenant_settle_failed", tenant=tenant.name, tokens=extra_tokens, error=str(exc))

    def lease_for_queue(self, tenant: Tenant) -> float | None:
        """When the leases of requests queued now lapse (None: the tenant's requests take none)."""
        if tenant.limits.max_concurrent_requests is None:
            return None
        return time.time() + self.lease_s

    async def release(self, tenant_name: str, req_ids: list[str]) -> None:
        if req_ids:
            await self.client.zrem(self.keys.tenant_leases(tenant_name), *req_ids)


def _window_storage(client: aioredis.Redis, keys: Keys, redis_url: str | None):
    """The rate windows' storage: the gateway's own connection pool on one server (the same
    Redis, credentials and TLS); on a cluster, `limits`' cluster storage on the same nodes."""
    prefix = f"{keys.prefix}limits"
    if redis_url is not None and is_cluster_url(redis_url):
        nodes = ",".join(f"{host}:{port}" for host, port in cluster_nodes(redis_url))
        return RedisClusterStorage(f"async+redis+cluster://{nodes}", implementation="redispy",
                                   key_prefix=prefix,
                                   **cluster_options(redis_url))
    return RedisStorage("async+redis://", implementation="redispy", connection_pool=client.connection_pool,
                        key_prefix=prefix)


# The app's key of this process's one TenantLimiter (opened in gateway/http/app.py's cleanup_ctx).
LIMITER = web.AppKey("limiter", TenantLimiter)
