"""`tokenfleet gateway`: serve the app until SIGINT/SIGTERM; with --workers N, as one of N
processes sharing the port (gateway/http/supervisor.py starts and watches them)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

from aiohttp import web

from gateway.core.settings import GatewaySettings
from gateway.http.app import create_app
from gateway.http.middlewares import AccessLogger
from shared.gc_tuning import tune_for_serving
from shared.logging import get_logger

log = get_logger("tokenfleet.gateway")
SHUTDOWN_TIMEOUT_S = 10.0  # open streams get this long to end before they are cut


def serve(settings: GatewaySettings, *, reuse_port: bool = False,
          on_ready: Callable[[], None] | None = None) -> None:
    """Until SIGINT or SIGTERM. reuse_port: bind with SO_REUSEPORT, so that several processes
    listen on one port and the kernel spreads connections over them. on_ready: called once
    the port is open."""
    log.info("gateway_starting", host=settings.host, port=settings.port,
             models=[m.name for m in settings.models], redis_url=settings.redis_url)
    asyncio.run(_serve(settings, reuse_port, on_ready))


async def _serve(settings: GatewaySettings, reuse_port: bool, on_ready: Callable[[], None] | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # handler_cancellation: a client that disconnects cancels its handler at once, which
    # cancels its requests in the fleet (the SSE write error would catch it one token later).
    runner = web.AppRunner(create_app(settings), handler_cancellation=True, access_log_class=AccessLogger,
                           shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()  # the app's cleanup_ctx: models, Redis, pub/sub, ingester (fails here, clearly)
    tune_for_serving()  # the tokenizers are loaded: the startup heap leaves the collector's walks
    try:
        site = web.TCPSite(runner, settings.host, settings.port, reuse_port=reuse_port or None)
        await site.start()
        if on_ready is not None:
            on_ready()
        await stop.wait()
        log.info("gateway_stopping")
    finally:
        await runner.cleanup()
