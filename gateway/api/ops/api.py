"""GET /health, /ready and /metrics."""

from __future__ import annotations

import os

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from gateway.core.appkeys import METRICS, REDIS
from gateway.fleet.engine_metrics import read_fleet_metrics
from gateway.fleet.queue_times import QUEUE_TIMES
from gateway.fleet.tracker import FLEET
from gateway.serving.store import STORE
from gateway.tokens.models import MODELS


async def health(request: web.Request) -> web.Response:
    """The process is up; `pid` says which one (`tokenfleet gateway --workers N` runs N)."""
    return web.json_response({"status": "ok", "pid": os.getpid()})


async def ready(request: web.Request) -> web.Response:
    """200 when Redis answers and a live scheduler serves a model this gateway fronts."""
    fleet = request.app[FLEET]
    try:
        await request.app[REDIS].ping()
        await fleet.refresh()
    except (RedisError, OSError) as exc:
        return web.json_response({"status": "not_ready", "redis": False, "models": [],
                                  "reason": f"redis unreachable: {exc}"}, status=503)
    served = fleet.served_models
    if not served:
        return web.json_response({"status": "not_ready", "redis": True, "models": [],
                                  "reason": "no live scheduler serves a model this gateway fronts"},
                                 status=503)
    return web.json_response({"status": "ready", "redis": True, "models": served})


async def metrics(request: web.Request) -> web.Response:
    app = request.app
    for model in app[MODELS].names:  # queue depths as of now, not as of the last refresh
        try:
            app[METRICS].queue_depth.labels(model).set(await app[STORE].queue_depth(model))
        except (RedisError, OSError):
            break
    await app[QUEUE_TIMES].flush()  # the queue times of calls that ended since the last look
    body = app[METRICS].render()
    try:  # and every live scheduler's engine metrics (tokenfleet:*), as they last reported them
        body += await read_fleet_metrics(app[REDIS], app[STORE].keys)
    except (RedisError, OSError):
        pass  # the gateway's own metrics still answer while Redis is away
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
