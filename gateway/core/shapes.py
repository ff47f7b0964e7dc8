"""The shapes of the HTTP responses, for /openapi.json (the handlers build the same shapes as
dicts), and the base of every request body (StrictModel: unknown fields refused)."""

from __future__ import annotations

from typing import Any, Literal

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


class PromptTokensDetails(Shape):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(Shape):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Shape):
    content: list[TokenLogprob] | None


class FunctionCall(Shape):
    name: str
    arguments: str  # JSON text


class ToolCall(Shape):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(Shape):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None  # with tools in play: the calls the answer makes


class ChatChoice(Shape):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(Shape):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(Shape):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Shape):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(Shape):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(Shape):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str | None = None  # a LoRA adapter's folder
    parent: str | None = None  # a LoRA adapter's base model


class LoraAdapter(Shape):
    object: Literal["lora_adapter"]
    lora_name: str
    parent: str | None = None
    rank: int | None = None
    owned_by: str | None = None
    deleted: bool | None = None


class Tokenized(Shape):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class Detokenized(Shape):
    prompt: str


class ModelList(Shape):
    object: Literal["list"]
    data: list[ModelCard]


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


class Health(Shape):
    status: str
    pid: int  # the gateway process that answered


class Ready(Shape):
    status: Literal["ready", "not_ready"]
    redis: bool
    models: list[str]
    reason: str | None = None
