"""One line of a batch job: the OpenAI Batch input format in, the OpenAI Batch output format out.

Input:  {"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
Output: {"id": "batch_req_...", "custom_id": "...", "response": {"status_code": 200,
         "request_id": "...", "body": <the same object the REST route answers>}, "error": null}
A line the REST route would answer with a 4xx gets that status and error body as its
response; a line that never ran (cancelled, expired, failed in the fleet) gets `error`
instead, as OpenAI's batch API does.

Checked twice: once when the job is taken in (so a malformed line is known before anything
runs and the job's model is settled), then again, with the model's tokenizer, when the line
is queued (prompt length, chat template), because tokenizing a million lines up front would
hold that many prompts in Redis.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.api.batch.entry import URLS
from gateway.api.embeddings.schemas import EmbeddingRequest
from gateway.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.errors import BadRequest, GatewayError, error_body, validation_error

BODY_SCHEMAS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                "/v1/embeddings": EmbeddingRequest}
# a body's must-have
ENDPOINT_INPUTS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/embeddings": "input"}


class InputLine(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: Literal[URLS]
    body: dict


@dataclass
class LineItem:
    """A line as the job keeps it between intake and queueing (msgpack in tf:batch:{job}:lines)."""

    index: int  # position in the job's input, from 0
    raw: str  # the line as given
    custom_id: str | None = None
    error: dict | None = None  # {"status_code", "code", "message", "param"} when intake refused it

    def pack(self) -> bytes:
        return msgpack.packb([self.index, self.raw, self.custom_id, self.error], use_bin_type=True)

    @classmethod
    def unpack(cls, data: bytes) -> LineItem:
        index, raw, custom_id, error = msgpack.unpackb(data, raw=False)
        return cls(index, raw, custom_id, error)


def refusal_of(exc: GatewayError) -> dict:
    """What a refused line's output says: the status and error the REST route would answer."""
    return {"status_code": exc.http_status, "code": exc.code or "invalid_value", "message": exc.message,
            "param": exc.param, "type": exc.error_type}


def parse_line(raw: str) -> tuple[InputLine, ChatCompletionRequest | CompletionRequest | EmbeddingRequest]:
    """The line and its validated body; BadRequest naming the problem otherwise."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"the line is not valid JSON: {exc.msg} at column {exc.colno}",
                         code="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequest("the line must be a JSON object", code="invalid_json")
    try:
        line = InputLine.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    try:
        body = BODY_SCHEMAS[line.url].model_validate(line.body)
    except ValidationError as exc:
        inner = validation_error(exc)
        raise BadRequest(f"body: {inner.message}", param=f"body.{inner.param}" if inner.param else "body",
                         code=inner.code) from None
    if getattr(body, "stream", False):
        raise BadRequest("stream is not supported in a batch job", param="body.stream")
    return line, body


def check_lines(raws: list[str], *, model: str | None) -> tuple[list[LineItem], str | None]:
    """Intake: every line checked without a tokenizer. Returns the items (a refused one carries
    its error) and the job's model: `model` when given, else the first valid line's. (Lines that
    are not for the job's endpoint refuse the whole job before this: endpoint_mismatch.)"""
    items: list[LineItem] = []
    seen: set[str] = set()
    for index, raw in enumerate(raws):
        item = LineItem(index, raw)
        items.append(item)
        try:
            line, body = parse_line(raw)
        except GatewayError as exc:
            item.custom_id = _custom_id_of(raw)
            item.error = refusal_of(exc)
            continue
        item.custom_id = line.custom_id
        if line.custom_id in seen:
            item.error = refusal_of(BadRequest(f"custom_id {line.custom_id!r} appears earlier in the job; "
                                             "each line needs its own", param="custom_id",
                                             code="duplicate_custom_id"))
            continue
        seen.add(line.custom_id)
        if model is None:
            model = body.model
        elif body.model is not None and body.model != model:
            item.error = refusal_of(BadRequest(f"body.model {body.model!r} differs from the job's model "
                                             f"{model!r}; a job runs one model", param="body.model",
                                             code="model_mismatch"))
    return items, model


@dataclass
class EndpointMismatch:
    """The first line of a job that is not a request to the job's endpoint."""

    line: int  # its number in the job's text, from 1 (blank lines count, as in an editor)
    message: str  # names the line, its custom_id and what is wrong
    param: str  # the line's field at fault: "url", "body.messages"...


def endpoint_mismatch(content: str, endpoint: str) -> EndpointMismatch | None:
    """The first line of the job's text that is for another endpoint: a url that differs, or a body
    without the endpoint's input (`messages` for chat, `prompt` for completions). OpenAI refuses
    such a batch as a whole, when it is created; a line malformed in any other way (bad JSON, an
    unknown field...) is that line's own error, and the job goes on."""
    needed = ENDPOINT_INPUTS[endpoint]
    for number, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            data = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if not isinstance(data, dict):
            continue
        url, body, custom_id = data.get("url"), data.get("body"), data.get("custom_id")
        if isinstance(url, str) and url != endpoint:
            why, param = f"its url {url[:80]!r} is not the batch's endpoint {endpoint!r}", "url"
        elif isinstance(body, dict) and needed not in body:
            why, param = f"its body has no {needed!r}: it is not a {endpoint} request", f"body.{needed}"
        else:
            continue
        named = f" (custom_id {custom_id[:80]!r})" if isinstance(custom_id, str) else ""
        return EndpointMismatch(number, f"line {number}{named}: {why}", param)
    return None


def _custom_id_of(raw: str) -> str | None:
    """The custom_id of a refused line, when one can be read from it."""
    try:
        value = json.loads(raw).get("custom_id")
    except (json.JSONDecodeError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def split_lines(content: str) -> list[str]:
    """JSONL text -> its lines, blank lines dropped (a trailing newline is not a line)."""
    return [line for line in content.splitlines() if line.strip()]


# -- output lines ------------------------------------------------------------------------


def output_line(custom_id: str | None, request_id: str, body: dict) -> str:
    return _dumps({"id": f"batch_req_{request_id}", "custom_id": custom_id,
                   "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None})


def refused_line(custom_id: str | None, request_id: str, refusal: dict) -> str:
    """A line the REST route would have refused: its status and OpenAI error body."""
    body = error_body(refusal["message"], refusal.get("type", "invalid_request_error"), refusal.get("param"),
                      refusal.get("code"))
    return _dumps({"id": f"batch_req_{request_id}", "custom_id": custom_id,
                   "response": {"status_code": refusal["status_code"], "request_id": request_id,
                                "body": body},
                   "error": None})


def error_line(custom_id: str | None, request_id: str, code: str, message: str) -> str:
    """A line that did not run to the end (cancelled, expired, failed in the fleet)."""
    return _dumps({"id": f"batch_req_{request_id}", "custom_id": custom_id, "response": None,
                   "error": {"code": code, "message": message}})


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
