"""Cross-cutting concerns: request ids, errors in OpenAI's shape, API keys, access logs."""

from __future__ import annotations

import hmac
import re
import uuid

import structlog
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from pydantic import ValidationError

from gateway.core.appkeys import API_KEY, METRICS, REQUEST_ID, SETTINGS
from gateway.errors import (
    AuthenticationFailed,
    Unavailable,
    error_response,
    http_error_response,
    validation_error,
)
from gateway.serving.handlers import ClientGone
from gateway.tenants.access import TENANT, require_admin
from gateway.tenants.registry import TENANTS
from shared.errors import TokenfleetError
from shared.logging import get_logger
from shared.redis_client import redis_away

log = get_logger("tokenfleet.gateway")
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
# No API key needed: probes, the API's description, the status page (its data comes from
# /fleet.json, which it asks a key for when refused).
OPEN_PATHS = frozenset({"/health", "/ready", "/openapi.json", "/"})
# The fleet-wide views name hosts, pids, jobs and errors: open only on an open gateway (no
# --api-key, no tenants) or with --public-metrics; with --api-key they need one of its keys, and
# with tenants an admin tenant's key (they name every tenant's work).
ADMIN_PATHS = frozenset({"/metrics", "/fleet.json"})


def is_guarded(path: str, *, secured: bool, public_views: bool) -> bool:
    """Whether a call to `path` needs a key, on a gateway that has keys or tenants (`secured`)
    or none, and that opens the fleet-wide views (--public-metrics) or not."""
    if not secured or path in OPEN_PATHS:
        return False
    return not (public_views and path in ADMIN_PATHS)


@web.middleware
async def request_id_middleware(request: web.Request, handler) -> web.StreamResponse:
    """X-Request-Id: the client's when it is sane, else ours; on the response and every log line."""
    given = request.headers.get("X-Request-Id", "")
    request_id = given if _CLIENT_REQUEST_ID.match(given) else uuid.uuid4().hex
    request[REQUEST_ID] = request_id
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
    except ClientGone:
        response = web.Response(status=499)  # nobody reads it; the requests were cancelled
    except Exception as exc:  # noqa: BLE001 - the one place that turns a bug into a clean 500
        if redis_away(exc):  # (unreachable, failing over: shared/redis_client.py)
            log.warning("redis_unreachable", error=repr(exc))
            response = error_response(Unavailable("the queue (Redis) is unreachable; retry later",
                                                  code="redis_unavailable", headers={"Retry-After": "1"}))
        else:
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
    its own work only (gateway/tenants/access.py)."""
    settings = request.app[SETTINGS]
    keys = settings.api_keys
    tenants = request.app[TENANTS]
    guarded = is_guarded(request.path, secured=bool(keys) or tenants.is_enabled,
                         public_views=settings.public_metrics)
    is_admin_view = guarded and tenants.is_enabled and request.path in ADMIN_PATHS
    if guarded:
        given = _api_key(request)
        if given is None:
            raise AuthenticationFailed("missing API key: send Authorization: Bearer <key>")
        tenant = await tenants.lookup(given)
        if tenant is None and not any(hmac.compare_digest(given.encode(), key.encode()) for key in keys):
            raise AuthenticationFailed("invalid API key")
        request[API_KEY] = given
        request[TENANT] = tenant
    if is_admin_view:
        require_admin(request)
    return await handler(request)


class AccessLogger(AbstractAccessLogger):
    """One structured line per request, with its request id."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time_s: float) -> None:
        log.info("http_request", method=request.method, path=request.path, status=response.status,
                 duration_ms=round(time_s * 1000, 2), request_id=request.get(REQUEST_ID),
                 remote=request.remote, bytes=response.body_length)

    @property
    def enabled(self) -> bool:
        return True
