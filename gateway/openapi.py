"""/openapi.json, generated from the route table and the pydantic models."""

from __future__ import annotations

from pydantic import BaseModel, TypeAdapter

from gateway.middlewares import OPEN_PATHS
from gateway.responses import ErrorResponse
from gateway.routes import ROUTES, Route

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
    if route.path in OPEN_PATHS:
        op["security"] = []
    return op


def openapi_document(*, secured: bool, title: str = "tokenfleet gateway", version: str = "0.1.0") -> dict:
    """secured: API keys are configured (Authorization: Bearer on every route but the open ones)."""
    components = _Components()
    paths: dict[str, dict] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, components)
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
