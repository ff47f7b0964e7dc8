"""`tokenfleet gateway`: serve the app until SIGINT/SIGTERM."""

from __future__ import annotations

from aiohttp import web

from gateway.app import create_app
from gateway.middlewares import AccessLogger
from gateway.settings import GatewaySettings
from shared.logging import get_logger

log = get_logger("tokenfleet.gateway")


def serve(settings: GatewaySettings) -> None:
    log.info("gateway_starting", host=settings.host, port=settings.port,
             models=[m.name for m in settings.models], redis_url=settings.redis_url)
    # handler_cancellation: a client that disconnects cancels its handler at once, which
    # cancels its requests in the fleet (the SSE write error would catch it one token later).
    web.run_app(create_app(settings), host=settings.host, port=settings.port, handler_cancellation=True,
                access_log_class=AccessLogger, print=None, shutdown_timeout=10)
