"""Cross-cutting concerns: request ids, errors in OpenAI's shape, API keys, access logs."""

from __future__ import annotations

import hmac
import os
import re
import uuid

import structlog
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from pydantic import ValidationError
from redis.exceptions import ClusterError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.appkeys import METRICS, SETTINGS, TENANTS
from gateway.errors import (
    AuthenticationFailed,
    Unavailable,
    error_response,
    http_error_response,
    validation_error,
)
from gateway.requests.serving import ClientGone
from gateway.tenants_access import require_admin
from shared.errors import TokenfleetError
from shared.logging import get_logger

log = get_logger("tokenfleet.gateway")
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
# No API key needed: probes, metrics, the API's description, the status page and its data.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/openapi.json", "/", "/fleet.json"})
# The fleet-wide views: open without tenants; with tenants they name every tenant's work (batch
# jobs, refusals by tenant), so they need an admin tenant's key. The page at / stays open: its
# data comes from /fleet.json.
ADMIN_PATHS = frozenset({"/metrics", "/fleet.json"})


@web.middleware
async def request_id_middleware(request: web.Request, handler) -> web.StreamResponse:
    """X-Request-Id: the client's when it is sane, else ours; on the response and every log line."""
    given = request.headers.get("X-Request-Id", "")
    request_id = given if _CLIENT_REQUEST_ID.match(given) else uuid.uuid4().hex
    request["request_id"] = request_id
    structlog.contextvars.bind_contextvars(request_id=request_id)
    try:
        response = await handler(request)
    finally:
        structlog.contextvars.unbind_contextvars("request_id")
    if not response.prepared:
        response.headers["X-Request-Id"] = request_id
    return response


def _route_name(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _raised_inside_redis_client(exc: BaseException) -> bool:
    """Whether the innermost frame of exc's traceback is in the redis package's code."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f"{os.sep}redis{os.sep}" in tb.tb_frame.f_code.co_filename


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Every error becomes {"error": {...}} with its status; counts responses by route and status."""
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = http_error_response(exc)
    except ValidationError as exc:
        response = error_response(validation_error(exc))
    except TokenfleetError as exc:
        response = error_response(exc)
    except (RedisConnectionError, RedisTimeoutError, ClusterError) as exc:
        log.warning("redis_unreachable", error=str(exc))
        response = error_response(Unavailable("the queue (Redis) is unreachable; retry later",
                                              code="redis_unavailable", headers={"Retry-After": "1"}))
    except ClientGone:
        response = web.Response(status=499)  # nobody reads it; the requests were cancelled
    except AttributeError as exc:
        if not _raised_inside_redis_client(exc):
            raise
        # redis-py's asyncio client, mid-failover, can use a connection another task just
        # closed (its writer None): the shard is away, as for a ConnectionError.
        log.warning("redis_unreachable", error=repr(exc))
        response = error_response(Unavailable("the queue (Redis) is unreachable; retry later",
                                              code="redis_unavailable", headers={"Retry-After": "1"}))
    except Exception:  # noqa: BLE001 - the one place that turns a bug into a clean 500
        log.exception("unhandled_error", path=request.path)
        response = error_response(TokenfleetError("internal error; see the gateway's log"))
    request.app[METRICS].http_requests.labels(request.method, _route_name(request), response.status).inc()
    return response


def _api_key(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


@web.middleware
async def auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Authorization: Bearer <key> must be one of --api-key or a tenant's key (when any is
    configured). A tenant's key puts the tenant on the request: its limits apply, and it sees
    its own work only (gateway/tenants_access.py)."""
    keys = request.app[SETTINGS].api_keys
    tenants = request.app[TENANTS]
    is_admin_view = tenants.is_enabled and request.path in ADMIN_PATHS
    if (keys or tenants.is_enabled) and (request.path not in OPEN_PATHS or is_admin_view):
        given = _api_key(request)
        if given is None:
            raise AuthenticationFailed("missing API key: send Authorization: Bearer <key>")
        tenant = await tenants.lookup(given)
        if tenant is None and not any(hmac.compare_digest(given.encode(), key.encode()) for key in keys):
            raise AuthenticationFailed("invalid API key")
        request["api_key"] = given
        request["tenant"] = tenant
    if is_admin_view:
        require_admin(request)
    return await handler(request)


class AccessLogger(AbstractAccessLogger):
    """One structured line per request, with its request id."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time_s: float) -> None:
        log.info("http_request", method=request.method, path=request.path, status=response.status,
                 duration_ms=round(time_s * 1000, 2), request_id=request.get("request_id"),
                 remote=request.remote, bytes=response.body_length)

    @property
    def enabled(self) -> bool:
        return True
