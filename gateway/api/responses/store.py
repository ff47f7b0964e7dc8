"""Stored responses: `tf:resp:{P}:{req_id}` (protocol/keys.py), beside the request's record.

The hash holds what was asked (the spec: input items, the context a previous response gave,
tools, format, sampling, metadata; JSON, written once) and the owning tenant; what came out is
the request's own `tf:res` record. It lives as long as that record (the gateway's
result_ttl_s), so a stored response is retrievable as long as its output is.
"""

from __future__ import annotations

import json

import redis.asyncio as aioredis

from protocol.keys import Keys

_SPEC, _TENANT = "spec", "tenant"


class ResponseStore:
    def __init__(self, client: aioredis.Redis, keys: Keys, ttl_s: int) -> None:
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s

    async def save(self, spec: dict, tenant: str | None) -> None:
        key = self.keys.response(spec["req_id"])
        fields = {_SPEC: json.dumps(spec, separators=(",", ":"))}
        if tenant is not None:
            fields[_TENANT] = tenant
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(key, mapping=fields)
        pipe.expire(key, self.ttl_s)
        await pipe.execute()

    async def load(self, req_id: str) -> tuple[dict, str | None] | None:
        """(spec, tenant), or None for a response never stored, deleted or expired."""
        raw = await self.client.hgetall(self.keys.response(req_id))
        if not raw or _SPEC.encode() not in raw:
            return None
        tenant = raw.get(_TENANT.encode())
        return json.loads(raw[_SPEC.encode()]), tenant.decode() if tenant is not None else None

    async def delete(self, req_id: str) -> bool:
        return bool(await self.client.delete(self.keys.response(req_id)))
