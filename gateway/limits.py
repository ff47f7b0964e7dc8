"""A tenant's limits, enforced in Redis so that every gateway process shares the counters.

- requests and tokens per minute: `limits`' sliding-window counters in Redis (two counters
  per window, whatever the cost, so a token budget costs no more than a request budget);
- concurrent requests: leases, one member per request in the sorted set
  `tf:tenant:{name}:leases`, scored by when the lease lapses. A lease is taken before the
  request is queued, for `pending_lease_s` (a gateway that dies before queueing loses only
  that long); queueing it makes it last `lease_s`. It ends when the request ends: the
  scheduler's terminal write removes it (service/result_store.py), whoever's client
  waited, left or never waited; the gateway removes it at once when it cancels a request
  nobody has claimed, or when its own client leaves. A lease nobody ended lapses.

Over a limit: 429 with Retry-After, and the limit's name as the error's code.
"""

from __future__ import annotations

import math
import time

import redis.asyncio as aioredis
from limits import RateLimitItemPerMinute
from limits.aio.storage import RedisStorage
from limits.aio.strategies import SlidingWindowCounterRateLimiter

from gateway.errors import BadRequest, RateLimited
from gateway.tenants import Tenant
from protocol.keys import Keys

# KEYS: the tenant's lease set.  ARGV: now, lapses at, cap, req ids...
# Lapsed leases go first; then all of the call's requests get a lease, or none does.
_ACQUIRE_SCRIPT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local held = redis.call('ZCARD', KEYS[1])
if held + #ARGV - 3 > tonumber(ARGV[3]) then return held end
for i = 4, #ARGV do redis.call('ZADD', KEYS[1], ARGV[2], ARGV[i]) end
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) - tonumber(ARGV[1])) + 1)
return -1
"""


class TenantLimiter:
    def __init__(self, client: aioredis.Redis, keys: Keys, *, lease_s: float, pending_lease_s: float,
                 retry_after_s: int) -> None:
        self.client = client
        self.keys = keys
        self.lease_s = lease_s
        self.pending_lease_s = pending_lease_s
        self.retry_after_s = retry_after_s
        # The gateway's own connection pool: the same Redis, credentials and TLS.
        storage = RedisStorage("async+redis://", implementation="redispy",
                               connection_pool=client.connection_pool, key_prefix=f"{keys.prefix}limits")
        self._windows = SlidingWindowCounterRateLimiter(storage)
        self._acquire = client.register_script(_ACQUIRE_SCRIPT)

    async def admit(self, tenant: Tenant, req_ids: list[str], num_tokens: int) -> None:
        """Take the tenant's quota for these requests (one per choice) and their `num_tokens`
        (prompts + max_tokens), or raise 429 naming the limit that is reached."""
        limits = tenant.limits
        if limits.tokens_per_minute is not None and num_tokens > limits.tokens_per_minute:
            raise BadRequest(f"this call needs {num_tokens} tokens (prompt + max_tokens), more than tenant "
                             f"{tenant.name!r} may use in a minute ({limits.tokens_per_minute})",
                             param="max_tokens", code="tokens_per_minute")
        await self._take_leases(tenant, req_ids)
        try:
            await self._take_rates(tenant, len(req_ids), num_tokens)
        except BaseException:
            await self.release(tenant.name, req_ids)
            raise

    async def _take_leases(self, tenant: Tenant, req_ids: list[str]) -> None:
        cap = tenant.limits.max_concurrent_requests
        if cap is None:
            return
        now = time.time()
        held = await self._acquire(keys=[self.keys.tenant_leases(tenant.name)],
                                   args=[now, now + self.pending_lease_s, cap, *req_ids])
        if held >= 0:
            raise RateLimited(f"tenant {tenant.name!r} has {held} requests in flight; its limit "
                              f"max_concurrent_requests is {cap}", code="max_concurrent_requests",
                              headers={"Retry-After": str(self.retry_after_s)})

    async def _take_rates(self, tenant: Tenant, num_requests: int, num_tokens: int) -> None:
        limits = tenant.limits
        wanted = (("requests_per_minute", limits.requests_per_minute, num_requests),
                  ("tokens_per_minute", limits.tokens_per_minute, num_tokens))
        windows = [(name, RateLimitItemPerMinute(amount), cost) for name, amount, cost in wanted
                   if amount is not None]
        # Every window is tested before any is charged: a call refused for its tokens does not use
        # up a request. (Two gateways may both pass the test; the charge itself is checked again.)
        for name, item, cost in windows:
            if not await self._windows.test(item, tenant.name, name, cost=cost):
                await self._refuse(tenant, name, item)
        for name, item, cost in windows:
            if not await self._windows.hit(item, tenant.name, name, cost=cost):
                await self._refuse(tenant, name, item)

    async def _refuse(self, tenant: Tenant, name: str, item: RateLimitItemPerMinute) -> None:
        stats = await self._windows.get_window_stats(item, tenant.name, name)
        retry_after = max(1, math.ceil(stats.reset_time - time.time()))
        raise RateLimited(f"tenant {tenant.name!r} reached its limit {name} ({item.amount} per minute); "
                          f"retry in {retry_after} s", code=name, headers={"Retry-After": str(retry_after)})

    def lease_for_queue(self, tenant: Tenant) -> float | None:
        """When the leases of requests queued now lapse (None: the tenant's requests take none)."""
        if tenant.limits.max_concurrent_requests is None:
            return None
        return time.time() + self.lease_s

    async def release(self, tenant_name: str, req_ids: list[str]) -> None:
        if req_ids:
            await self.client.zrem(self.keys.tenant_leases(tenant_name), *req_ids)
