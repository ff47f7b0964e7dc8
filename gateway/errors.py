"""Errors a client sees, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web
from pydantic import ValidationError

from shared.errors import TokenfleetError


class GatewayError(TokenfleetError):
    """An error with its HTTP status, OpenAI error type and code."""

    error_type = "invalid_request_error"
    http_status = 400
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message, param=param)
        if code is not None:
            self.code = code
        self.headers = headers or {}


class BadRequest(GatewayError):
    pass


class AuthenticationFailed(GatewayError):
    error_type = "authentication_error"
    http_status = 401
    code = "invalid_api_key"


class NotFound(GatewayError):
    http_status = 404
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Conflict(GatewayError):
    http_status = 409
    code = "conflict"


class RateLimited(GatewayError):
    error_type = "rate_limit_error"
    http_status = 429
    code = "queue_full"


class Unavailable(GatewayError):
    error_type = "service_unavailable"
    http_status = 503
    code = "unavailable"


class UpstreamFailed(GatewayError):
    """The request was accepted but ended badly in the fleet (dead-lettered, expired...)."""

    error_type = "server_error"
    http_status = 500
    code = "request_failed"


# aiohttp's own HTTP errors (unknown route, wrong method, body too large...) -> (type, code)
_HTTP_TYPES = {
    401: ("authentication_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
}


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(exc: TokenfleetError) -> web.Response:
    code = getattr(exc, "code", None)
    if code is None and exc.http_status == 400:
        code = "invalid_value" if exc.param else None
    headers = getattr(exc, "headers", None) or {}
    return web.json_response(error_body(exc.message, exc.error_type, exc.param, code),
                             status=exc.http_status, headers=headers)


def http_error_response(exc: web.HTTPException) -> web.Response:
    error_type, code = _HTTP_TYPES.get(exc.status, ("invalid_request_error", None))
    if exc.status >= 500:
        error_type = "server_error"
    message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
    headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
    return web.json_response(error_body(message, error_type, None, code), status=exc.status,
                             headers=headers)


_TYPE_TAGS = frozenset({"int", "str", "float", "bool", "dict", "list", "none"})


def param_of(loc: Sequence[int | str]) -> str | None:
    """A pydantic error location as a parameter path: ("messages", 0, "content") -> messages[0].content."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item in ("chat", "completion") and not parts:
            continue  # the discriminator tag of a submit body, not a field
        elif "[" in str(item) or str(item).startswith(("function-", "union[", "list[")) \
                or item in _TYPE_TAGS:
            continue  # union members' type tags (a field may start with one: stream_options)
        else:
            parts.append(f".{item}" if parts else str(item))
    return "".join(parts) or None


def validation_error(exc: ValidationError) -> BadRequest:
    """The first problem pydantic found, with the field it concerns."""
    errors = exc.errors(include_url=False)
    # Of the errors about the first bad field, the most specific: for a union (prompt: str or
    # list of ids...) that is the member that got furthest into the value.
    field = errors[0]["loc"][:1]
    first = max((e for e in errors if e["loc"][:1] == field), key=lambda e: len(e["loc"]))
    param = param_of(first["loc"])
    message = first["msg"]
    if first["type"] in ("union_tag_not_found", "union_tag_invalid"):
        param = str(first.get("ctx", {}).get("discriminator", "")).strip("'\"") or None
        if first["type"] == "union_tag_not_found":
            message = f"missing required parameter: {param}"
        else:
            message = f"{param}: {message}"
    elif first["type"] == "extra_forbidden":
        message = f"unsupported parameter: {param}"
    elif first["type"] == "missing":
        message = f"missing required parameter: {param}"
    elif param:
        message = f"{param}: {message}"
    return BadRequest(message, param=param, code=first["type"])
