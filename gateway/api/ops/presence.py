"""A gateway's heartbeat: `tf:gw:{gateway_id}`, a hash with a TTL, renewed every few seconds,
and its entry in the gateways' registry (protocol/registry.py), so that `tokenfleet status`
and the status page list the gateways of the fleet (each process of `tokenfleet gateway
--workers N` is one). Both go on a clean stop; a gateway that dies drops out when its key
expires."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import AsyncIterator

from aiohttp import web
from redis.exceptions import RedisError

from gateway.core.appkeys import REDIS, SETTINGS
from gateway.core.tasks import every
from gateway.serving.store import STORE
from protocol import registry
from shared.logging import get_logger

log = get_logger("tokenfleet.gateway.presence")
HEARTBEAT_S = 2.0
TTL_S = 10


def gateway_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


async def presence_ctx(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: beat until the app stops, then remove the key."""
    settings = app[SETTINGS]
    client = app[REDIS]
    keys = app[STORE].keys
    key = keys.gateway(gateway_id())
    fields = {"host": settings.host, "port": settings.port, "hostname": socket.gethostname(),
              "pid": os.getpid(), "models": json.dumps([m.name for m in settings.models]),
              "started_at": time.time()}
    stop = asyncio.Event()

    async def beat() -> None:
        pipe = client.pipeline(transaction=False)
        pipe.hset(key, mapping={**fields, "updated_at": time.time()})
        pipe.expire(key, TTL_S)
        await pipe.execute()
        await registry.beat_async(client, keys, registry.GATEWAYS, gateway_id(), TTL_S)

    task = asyncio.create_task(every(HEARTBEAT_S, stop, beat, "gateway_heartbeat_failed"),
                               name="gateway-presence")
    yield
    stop.set()
    await asyncio.gather(task, return_exceptions=True)
    with contextlib.suppress(RedisError, OSError):
        await registry.leave_async(client, keys, registry.GATEWAYS, gateway_id())
        await client.delete(key)
