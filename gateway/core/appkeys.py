"""Typed keys of what the app shares between handlers (opened and closed in cleanup_ctx), for
what every room uses. A room's own shared resource has its key beside its class (FLEET in
gateway/fleet/tracker.py, STORE in gateway/serving/store.py...), so that no room imports upward
for a key."""

from __future__ import annotations

import redis.asyncio as aioredis
from aiohttp import web

from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import GatewaySettings
from gateway.core.tasks import TaskSet

SETTINGS = web.AppKey("settings", GatewaySettings)
METRICS = web.AppKey("metrics", GatewayMetrics)
REDIS = web.AppKey("redis", aioredis.Redis)
TASKS = web.AppKey("tasks", TaskSet)

# What the middlewares put on each request for its handler.
REQUEST_ID = web.RequestKey("request_id", str)  # the client's X-Request-Id, or one made up
API_KEY = web.RequestKey("api_key", str)  # the key it authenticated with (idempotency is per key)
