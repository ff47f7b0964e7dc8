"""The answers of /health and /ready, for /openapi.json."""

from __future__ import annotations

from typing import Literal

from gateway.core.shapes import Shape


class Health(Shape):
    status: str
    pid: int  # the gateway process that answered


class Ready(Shape):
    status: Literal["ready", "not_ready"]
    redis: bool
    models: list[str]
    reason: str | None = None
