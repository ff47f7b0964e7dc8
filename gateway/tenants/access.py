"""Who may see what. With tenants configured, every request, file and batch job is the tenant's
whose key made it (the gateway records it server-side, at creation); another tenant gets the
404 an unknown id gets (as OpenAI answers another project's ids: a 403 would say it exists),
and lists show one's own only. What belongs to no tenant (made with a plain --api-key, or a
job written straight into tf:batch:in without a `tenant`) is the no-tenant callers': tenants
do not see it. An admin tenant (`"admin": true`) sees everything, and is the only one that
reads the fleet-wide views. Without tenants, everyone sees everything, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from aiohttp import web

from gateway.errors import GatewayError
from gateway.tenants.directory import Tenant
from gateway.tenants.registry import TENANTS

# Put on each request by the auth middleware (gateway/http/middlewares.py) for its handler.
TENANT = web.RequestKey("tenant", Tenant | None)  # None: a plain --api-key, no tenant's limits


class PermissionDenied(GatewayError):
    error_type = "permission_error"
    http_status = 403
    code = "admin_key_required"


@dataclass(frozen=True)
class Caller:
    tenant: str | None  # whose work the caller makes and sees; None: no tenant's
    sees_everything: bool  # an admin, or a fleet without tenants

    def can_see(self, owner: str | None) -> bool:
        return self.sees_everything or owner == self.tenant


def caller(request: web.Request) -> Caller:
    """The caller of this request (after the auth middleware put its tenant on it)."""
    tenant = request.get(TENANT)
    if not request.app[TENANTS].is_enabled:
        return Caller(None, sees_everything=True)
    if tenant is None:
        return Caller(None, sees_everything=False)
    return Caller(tenant.name, sees_everything=tenant.is_admin)


def require_admin(request: web.Request) -> None:
    """With tenants, the fleet-wide views name every tenant's work: an admin key only."""
    if not request.app[TENANTS].is_enabled:
        return
    tenant = request.get(TENANT)
    if tenant is None or not tenant.is_admin:
        raise PermissionDenied(f"{request.path} shows every tenant's work: it needs the key of an admin "
                               'tenant ("admin": true in the tenants file)')


async def visible_ids(client: aioredis.Redis, index: str, record_key: Callable[[str], str], who: Caller, *,
                      start: int = 0, count: int, chunk: int = 500) -> list[str]:
    """Up to `count` ids of the zset `index`, newest first from rank `start`, whose record
    (`record_key(id)`, a hash with a `tenant` field) the caller may see. Reads the index in
    chunks, so a tenant with few jobs among many still gets a full page. (An id added meanwhile
    shifts the ranks: an id read twice is kept once.)"""
    found: dict[str, None] = {}  # (ordered, no repeats)
    while len(found) < count:
        ids = [i.decode() for i in await client.zrevrange(index, start, start + chunk - 1)]
        start += len(ids)
        if who.sees_everything:
            found.update(dict.fromkeys(ids))
        else:
            pipe = client.pipeline(transaction=False)
            for item_id in ids:
                pipe.hget(record_key(item_id), "tenant")
            for item_id, owner in zip(ids, await pipe.execute(), strict=True):
                if who.can_see(owner.decode() if owner is not None else None):
                    found.setdefault(item_id)
        if len(ids) < chunk:  # the index's end
            break
    return list(found)[:count]

