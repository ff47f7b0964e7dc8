"""The bases of HTTP bodies: StrictModel, of every request body (unknown fields refused), and
Shape, of every response shape that /openapi.json describes (the handlers build the same shapes
as dicts; each endpoint family keeps its own in its `shapes.py`); and the error body every
route may answer."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A request body: an unknown field, a wrong type or a NaN is a 400 naming the field."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Shape(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(Shape):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Shape):
    error: ErrorDetail
