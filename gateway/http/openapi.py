"""/openapi.json, generated from the route table and the pydantic models."""

from __future__ import annotations

from pydantic import BaseModel, TypeAdapter

from gateway.core.shapes import ErrorResponse
from gateway.http.middlewares import ADMIN_PATHS, is_guarded
from gateway.http.routes import ROUTES, Route

REF = "#/components/schemas/{model}"
# One Server-Sent Event: `data` is a JSON object (a chunk, or a token event with `id: <seq>`)
# or the closing "[DONE]".
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string"}, "event": {"type": "string", "enum": ["message", "token", "error", "done"]},
    "id": {"type": "string", "pattern": "^[0-9]+$"}, "retry": {"type": "integer"}}}


class _Components:
    def __init__(self) -> None:
        self.schemas: dict[str, dict] = {}

    def ref(self, source: type[BaseModel] | tuple[str, TypeAdapter]) -> dict:
        if isinstance(source, tuple):
            name, adapter = source
            schema = adapter.json_schema(ref_template=REF)
        else:
            name, schema = source.__name__, source.model_json_schema(ref_template=REF)
        self.schemas.update(schema.pop("$defs", {}))
        self.schemas[name] = schema
        return {"$ref": REF.format(model=name)}


def _operation(route: Route, components: _Components) -> dict:
    op: dict = {"summary": route.summary, "operationId": route.handler.__name__,
                "parameters": list(route.parameters), "responses": {}}
    if route.body is not None:
        schema = components.ref(route.body)
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    if route.form is not None:
        op["requestBody"] = {"required": True, "content": {"multipart/form-data": {"schema": route.form}}}
    content: dict = {}
    if route.response is not None and not route.sse_only:
        content["application/json"] = {"schema": components.ref(route.response)}
    if route.sse:
        content["text/event-stream"] = {"schema": SSE_EVENT}
    if route.path == "/metrics":
        content["text/plain"] = {"schema": {"type": "string"}}
    content.update(route.content or {})
    op["responses"][str(route.status)] = {"description": "OK", "content": content}
    error = {"content": {"application/json": {"schema": components.ref(ErrorResponse)}}}
    for status in route.errors:
        op["responses"][str(status)] = {"description": "error", **error}
    return op


def _access(op: dict, path: str, components: _Components, *, secured: bool, public_views: bool,
            tenants: bool) -> None:
    """Who may call it, as the auth middleware decides (gateway/http/middlewares.py)."""
    if not is_guarded(path, secured=secured, public_views=public_views):
        op["security"] = []
    elif path in ADMIN_PATHS:
        op["security"] = [{"bearer": []}]
        who = "an admin tenant's API key" if tenants else "one of the gateway's API keys"
        op["description"] = (f"Needs {who}: it names the fleet's hosts, processes, jobs and errors "
                             "(`--public-metrics` opens it).")
        error = {"content": {"application/json": {"schema": components.ref(ErrorResponse)}}}
        op["responses"].setdefault("401", {"description": "no API key, or not one of the gateway's", **error})
        if tenants:
            op["responses"].setdefault("403", {"description": "the key is not an admin tenant's", **error})


def openapi_document(*, secured: bool, public_views: bool = False, tenants: bool = False,
                     title: str = "tokenfleet gateway", version: str = "0.1.0") -> dict:
    """secured: API keys or tenants are configured (Authorization: Bearer on every route but the
    open ones); tenants: the fleet-wide views need an admin tenant's key; public_views:
    --public-metrics opens them."""
    components = _Components()
    paths: dict[str, dict] = {}
    for route in ROUTES:
        op = _operation(route, components)
        _access(op, route.path, components, secured=secured, public_views=public_views, tenants=tenants)
        paths.setdefault(route.path, {})[route.method.lower()] = op
    paths["/openapi.json"] = {"get": {"summary": "This document", "operationId": "openapi", "security": [],
                                      "responses": {"200": {"description": "OK", "content": {
                                          "application/json": {"schema": {"type": "object"}}}}}}}
    document = {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
                "components": {"schemas": components.schemas}}
    if secured:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
    else:
        for methods in paths.values():
            for op in methods.values():
                op.pop("security", None)
    return document
