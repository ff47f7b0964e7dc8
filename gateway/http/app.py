"""The app factory: routes, middlewares, and every shared resource in a cleanup_ctx."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiohttp import web

from gateway.api.batch.ingester import BatchIngester
from gateway.api.batch.jobs import JOBS, JobStore
from gateway.api.ops.presence import presence_ctx
from gateway.core.appkeys import METRICS, REDIS, SETTINGS, TASKS
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import GatewaySettings
from gateway.core.tasks import TaskSet, running_until_stopped
from gateway.fleet.queue_depth import QUEUE_DEPTHS, QueueDepths
from gateway.fleet.queue_times import QUEUE_TIMES, QueueTimes
from gateway.fleet.routing import PrefixRouter
from gateway.fleet.tracker import FLEET, FleetTracker
from gateway.http.middlewares import auth_middleware, error_middleware, request_id_middleware
from gateway.http.openapi import openapi_document
from gateway.http.routes import ROUTES
from gateway.serving.pubsub import ROUTER, event_router
from gateway.serving.store import STORE, RequestStore
from gateway.tenants.limits import LIMITER, TenantLimiter
from gateway.tenants.registry import TENANTS, TenantRegistry
from gateway.tokens.models import MODELS, ModelRegistry
from gateway.tokens.tokenize_pool import TOKENIZE, TokenizePool
from protocol.keys import keys_for
from shared.logging import get_logger
from shared.redis_client import connect_async

log = get_logger("tokenfleet.gateway")


async def _models_ctx(app: web.Application) -> AsyncIterator[None]:
    # Tokenizers load for a while: off the event loop. A bad folder fails startup, clearly.
    app[MODELS] = await asyncio.to_thread(ModelRegistry.load, app[SETTINGS].models)
    app[TOKENIZE] = TokenizePool()
    yield
    app[TOKENIZE].close()


async def _redis_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    # Not pinged here: a gateway may start before Redis; /ready and 503s tell the difference.
    # A blocking pool: a burst of requests waits for a connection instead of failing.
    client = connect_async(settings.redis_url, blocking_pool=True,
                           max_connections=settings.redis_max_connections, timeout=10, socket_timeout=5,
                           socket_connect_timeout=2, health_check_interval=30)
    keys = keys_for(settings.redis_url, settings.key_prefix)
    app[REDIS] = client
    app[STORE] = RequestStore(client, keys, result_ttl_s=settings.result_ttl_s,
                              cancel_ttl_s=settings.cancel_ttl_s,
                              idempotency_ttl_s=settings.idempotency_ttl_s)
    app[JOBS] = JobStore(client, keys, record_ttl_s=settings.result_ttl_s)
    app[TENANTS] = TenantRegistry(settings.tenants, client if settings.tenants_from_redis else None, keys)
    app[LIMITER] = TenantLimiter(client, keys, lease_s=settings.tenant_lease_s,
                                 pending_lease_s=settings.tenant_pending_lease_s,
                                 retry_after_s=settings.retry_after_s, redis_url=settings.redis_url)
    yield
    await client.aclose()


async def _tasks_ctx(app: web.Application) -> AsyncIterator[None]:
    app[TASKS] = TaskSet()
    yield
    await app[TASKS].close()  # before Redis closes: cancels on their way out still get sent


async def _router_ctx(app: web.Application) -> AsyncIterator[None]:
    router = event_router(app[SETTINGS].redis_url, app[STORE].keys)
    await router.start()
    app[ROUTER] = router
    yield
    await router.close()


async def _queue_times_ctx(app: web.Application) -> AsyncIterator[None]:
    queue_times = QueueTimes(app[STORE], app[METRICS])
    app[QUEUE_TIMES] = queue_times
    async with running_until_stopped(queue_times.run, "queue-times"):
        yield
    await queue_times.flush()  # what the last calls left


async def _fleet_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    # (Routing by prefix runs on one server only: protocol/keys.py, replica_stream.)
    is_routed = settings.routing == "prefix" and not app[STORE].is_cluster
    router = PrefixRouter(app[METRICS]) if is_routed else None
    app[STORE].router = router
    fleet = FleetTracker(app[REDIS], app[STORE].keys, app[STORE], app[METRICS],
                         app[MODELS].names, grace_s=settings.scheduler_grace_s,
                         refresh_s=settings.fleet_refresh_s, router=router)
    app[FLEET] = fleet
    app[QUEUE_DEPTHS] = QueueDepths(app[STORE])
    async with running_until_stopped(fleet.run, "fleet-refresh"):
        yield
    await app[QUEUE_DEPTHS].close()


async def _batch_ctx(app: web.Application) -> AsyncIterator[None]:
    """The batch ingester of this process (gateway/api/batch/ingester.py), unless turned off."""
    settings = app[SETTINGS]
    if not settings.batch_ingester:
        yield
        return
    ingester = BatchIngester(app[REDIS], app[STORE].keys, app[MODELS], settings,
                             metrics=app[METRICS])
    stop = asyncio.Event()
    task = asyncio.create_task(ingester.run(stop), name="batch-ingester")
    yield
    stop.set()
    await asyncio.gather(task, return_exceptions=True)


def create_app(settings: GatewaySettings) -> web.Application:
    app = web.Application(
        middlewares=[request_id_middleware, error_middleware, auth_middleware],
        client_max_size=settings.max_body_bytes,
    )
    app[SETTINGS] = settings
    app[METRICS] = GatewayMetrics()
    # Opened in this order, closed in reverse: tasks close while Redis and the router live.
    app.cleanup_ctx.extend([_models_ctx, _redis_ctx, _router_ctx, _tasks_ctx, _queue_times_ctx, _fleet_ctx,
                            _batch_ctx, presence_ctx])
    for route in ROUTES:
        app.router.add_route(route.method, route.path, route.handler)
    has_tenants = bool(settings.tenants) or settings.tenants_from_redis
    document = openapi_document(secured=bool(settings.api_keys) or has_tenants, tenants=has_tenants,
                                public_views=settings.public_metrics)

    async def openapi(request: web.Request) -> web.Response:
        return web.json_response(document)

    app.router.add_get("/openapi.json", openapi)
    return app
