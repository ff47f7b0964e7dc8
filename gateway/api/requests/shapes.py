"""A submitted request as /v1/requests answers it, for /openapi.json."""

from __future__ import annotations

from typing import Any, Literal

from gateway.api.openai.shapes import ChatCompletion, Completion, Usage
from gateway.core.shapes import Shape


class Links(Shape):
    self: str
    events: str


class Output(Shape):
    text: str
    num_tokens: int
    finish_reason: str | None


class Timings(Shape):
    queued_at: float | None
    started_at: float | None
    first_token_at: float | None
    finished_at: float | None
    queue_s: float | None
    time_to_first_token_s: float | None
    total_s: float | None


class RequestStatus(Shape):
    """A submitted request: POST answers the queued view; GET and DELETE the full one."""

    id: str
    object: Literal["request"]
    kind: Literal["chat", "completion"] | None
    model: str | None
    status: Literal["queued", "running", "completed", "failed", "cancelled", "expired"]
    created: int | None  # integer seconds, fixed at submit (the record's queued_at)
    deadline: float | None = None
    output: Output | None = None
    usage: Usage | None = None
    error: dict[str, Any] | None = None
    timings: Timings | None = None
    last_event_id: int | None = None
    result: ChatCompletion | Completion | None = None
    links: Links
