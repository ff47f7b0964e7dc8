"""The responses of /v1/chat/completions, /v1/completions, /tokenize and /detokenize, for
/openapi.json (format.py builds the same shapes as dicts)."""

from __future__ import annotations

from typing import Literal

from gateway.core.shapes import Shape


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


class Tokenized(Shape):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class Detokenized(Shape):
    prompt: str
