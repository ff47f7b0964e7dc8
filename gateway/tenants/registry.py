"""Tenants kept in Redis, next to the keys file: keys and limits that change without a restart.

    HSET tf:apikeys <sha256 hex of the key> <tenant>       # a key of the tenant
    HSET tf:tenant:<tenant> requests_per_minute 600 ...     # its limits (fields of TenantLimits)
    HSET tf:tenant:<tenant> admin 1                         # an admin tenant (gateway/tenants/access.py)

(`tokenfleet tenants set` writes both.) A tenant written by hand with its key alone (no
`tf:tenant:<tenant>` hash, or an empty one) is a tenant with no limits, not an unknown key; a
name that could not be part of a key (TENANT_PATTERN) is refused, and said in the log. A
gateway started with `--tenants-from-redis` looks up a key the keys file does not know there,
and remembers the answer for `cache_s`, so a key costs one Redis round trip every few
seconds, not one per request. The keys file wins over Redis for a key both know.
"""

from __future__ import annotations

import re
import time
from dataclasses import fields

import redis.asyncio as aioredis
from aiohttp import web

from gateway.tenants.directory import Tenant, TenantDirectory, TenantLimits, key_digest
from protocol.keys import TENANT_PATTERN, Keys
from shared.logging import get_logger

log = get_logger("tokenfleet.gateway.tenants")
_TENANT = re.compile(TENANT_PATTERN)


class TenantRegistry:
    def __init__(self, directory: TenantDirectory, client: aioredis.Redis | None, keys: Keys,
                 cache_s: float = 5.0) -> None:
        self.directory = directory
        self.client = client  # None: the keys file only
        self.keys = keys
        self.cache_s = cache_s
        self._by_digest: dict[str, tuple[float, Tenant | None]] = {}  # digest -> (until, tenant)
        self._by_name: dict[str, tuple[float, Tenant | None]] = {}  # name -> (until, tenant)

    @property
    def is_enabled(self) -> bool:
        """Whether any key can map to a tenant (then every route but the open ones needs a key)."""
        return bool(self.directory) or self.client is not None

    async def lookup(self, api_key: str) -> Tenant | None:
        tenant = self.directory.lookup(api_key)
        if tenant is not None or self.client is None:
            return tenant
        digest = key_digest(api_key)
        cached = self._by_digest.get(digest)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        name = await self.client.hget(self.keys.api_keys, digest)
        tenant = None
        if name is not None:
            text = name.decode(errors="replace")
            if _TENANT.match(text):
                # (its key names it: a tenant, with its limits or with none)
                tenant = await self.get(text) or Tenant(text, TenantLimits())
            else:
                log.warning("tenant_name_unusable", tenant=text[:80], pattern=TENANT_PATTERN)
        self._remember(self._by_digest, digest, tenant)
        return tenant

    async def get(self, name: str) -> Tenant | None:
        """The tenant of that name, with its current limits (None: no such tenant in the keys
        file, and no hash of its limits in Redis)."""
        tenant = self.directory.get(name)
        if tenant is not None or self.client is None:
            return tenant
        cached = self._by_name.get(name)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        raw = await self.client.hgetall(self.keys.tenant(name))
        tenant = Tenant(name, _limits(name, raw), is_admin=raw.get(b"admin") == b"1") if raw else None
        self._remember(self._by_name, name, tenant)
        return tenant

    def _remember(self, cache: dict, key: str, tenant: Tenant | None) -> None:
        if len(cache) > 10_000:
            cache.clear()  # unknown keys tried in bulk must not grow it without end
        cache[key] = (time.monotonic() + self.cache_s, tenant)


def _limits(name: str, raw: dict[bytes, bytes]) -> TenantLimits:
    """Limits from the tenant's hash. A field that is not a positive integer is no limit, and
    said in the log (the hash is written by hand or by `tokenfleet tenants set`, which checks)."""
    values: dict[str, int | None] = {}
    for f in fields(TenantLimits):
        text = raw.get(f.name.encode(), b"").decode()
        values[f.name] = int(text) if text.isdigit() and int(text) > 0 else None
        if text and values[f.name] is None:
            log.warning("tenant_limit_unreadable", tenant=name, limit=f.name, value=text)
    return TenantLimits(**values)


# The app's key of this process's one TenantRegistry (opened in gateway/http/app.py's cleanup_ctx).
TENANTS = web.AppKey("tenants", TenantRegistry)  # API key -> tenant
