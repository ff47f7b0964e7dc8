"""Typed keys of what the app shares between handlers (opened and closed in cleanup_ctx)."""

from __future__ import annotations

import redis.asyncio as aioredis
from aiohttp import web

from gateway.api.batch.jobs import JobStore
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import GatewaySettings
from gateway.core.tasks import TaskSet
from gateway.fleet.queue_depth import QueueDepths
from gateway.fleet.queue_times import QueueTimes
from gateway.fleet.tracker import FleetTracker
from gateway.serving.pubsub import EventRouter
from gateway.serving.store import RequestStore
from gateway.tenants.directory import Tenant
from gateway.tenants.limits import TenantLimiter
from gateway.tenants.registry import TenantRegistry
from gateway.tokens.models import ModelRegistry
from gateway.tokens.tokenize_pool import TokenizePool

SETTINGS = web.AppKey("settings", GatewaySettings)
METRICS = web.AppKey("metrics", GatewayMetrics)
MODELS = web.AppKey("models", ModelRegistry)
TOKENIZE = web.AppKey("tokenize", TokenizePool)  # chat templates and tokenizers, off the event loop
REDIS = web.AppKey("redis", aioredis.Redis)
STORE = web.AppKey("store", RequestStore)
ROUTER = web.AppKey("router", EventRouter)
FLEET = web.AppKey("fleet", FleetTracker)
QUEUE_DEPTHS = web.AppKey("queue_depths", QueueDepths)  # admission against max_queue
TASKS = web.AppKey("tasks", TaskSet)
JOBS = web.AppKey("jobs", JobStore)
QUEUE_TIMES = web.AppKey("queue_times", QueueTimes)
TENANTS = web.AppKey("tenants", TenantRegistry)  # API key -> tenant
LIMITER = web.AppKey("limiter", TenantLimiter)

# What the middlewares put on each request for its handler.
REQUEST_ID = web.RequestKey("request_id", str)  # the client's X-Request-Id, or one made up
API_KEY = web.RequestKey("api_key", str)  # the key it authenticated with (idempotency is per key)
TENANT = web.RequestKey("tenant", Tenant | None)  # None: a plain --api-key, no tenant's limits
