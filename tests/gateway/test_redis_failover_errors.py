"""Redis failing over under a request answers 503 with Retry-After, not 500: a cluster that is
down for a moment (ClusterDownError) and redis-py's own slip on a connection another task just
closed (an AttributeError raised inside the redis package). A bug of ours stays a 500."""

from __future__ import annotations

import pytest
from aiohttp import web
from redis.exceptions import ClusterDownError

from gateway.core.appkeys import METRICS
from gateway.core.metrics import GatewayMetrics
from gateway.http.middlewares import error_middleware

pytestmark = pytest.mark.asyncio


async def _redis_internal_slip(request: web.Request) -> web.Response:
    from redis.asyncio.connection import Connection

    connection = Connection()  # never connected: its writer is None, as after a teardown
    await connection._send_packed_command([b"PING\r\n"])
    return web.Response(text="unreachable")


async def _cluster_down(request: web.Request) -> web.Response:
    raise ClusterDownError("The cluster is down")


async def _our_bug(request: web.Request) -> web.Response:
    return None.missing  # type: ignore[attr-defined]


async def test_failover_errors_are_503_and_our_bugs_500(aiohttp_client) -> None:
    app = web.Application(middlewares=[error_middleware])
    app[METRICS] = GatewayMetrics()
    app.router.add_get("/slip", _redis_internal_slip)
    app.router.add_get("/down", _cluster_down)
    app.router.add_get("/bug", _our_bug)
    client = await aiohttp_client(app)
    for path in ("/slip", "/down"):
        response = await client.get(path)
        assert response.status == 503, (path, await response.text())
        assert response.headers["Retry-After"] == "1"
        assert (await response.json())["error"]["code"] == "redis_unavailable"
    response = await client.get("/bug")
    assert response.status == 500
