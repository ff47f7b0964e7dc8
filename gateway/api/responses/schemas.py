"""The body of POST /v1/responses, validated by pydantic (strict, unknown fields refused).

What we serve is declared with its type; what OpenAI's reference has and we do not serve is
declared too, but only its no-op value passes (null, [], "disabled"...): anything else is a
400 naming the field, so nothing a client asks for is silently ignored. The input items, the
tools and `text.format` are checked item by item in gateway/api/responses/translate.py, where
each refusal can name its full path (`input[2].content[0].type`, `tools[1].type`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gateway.core.shapes import StrictModel
from gateway.errors import BadRequest

MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class TextConfig(StrictModel):
    format: dict[str, Any] | None = Field(None, description="{type: text | json_object | json_schema, ...}")
    verbosity: Literal["medium"] | None = Field(None, description="only medium (the model's own)")


# Declared so that their no-op values pass; a value we would have to honour is refused.
_NO_OP = {
    "reasoning": (None, {}),
    "include": (None, []),
    "truncation": (None, "disabled"),
    "service_tier": (None, "auto", "default"),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
    "prompt": (None,),
    "conversation": (None,),
    "stream_options": (None, {}, {"include_obfuscation": False}),
    "context_management": (None,),
    "prompt_cache_retention": (None,),
    "prompt_cache_options": (None,),
}
_WHY = {
    "reasoning": "this server's models have no reasoning settings",
    "include": "no extra output (logprobs, search results, reasoning) is served",
    "truncation": "only 'disabled': an input longer than the context window is a 400",
    "service_tier": "one service tier: 'auto' or 'default'",
    "top_logprobs": "logprobs are not served on /v1/responses",
    "max_tool_calls": "built-in tools are not served",
    "prompt": "stored prompt templates are not served",
    "conversation": "conversations are not served (chain responses with previous_response_id)",
    "stream_options": "no stream obfuscation is served: only include_obfuscation false",
    "context_management": "context management is not served",
    "prompt_cache_retention": "the prefix cache is automatic",
    "prompt_cache_options": "the prefix cache is automatic",
}


class ResponseCreate(StrictModel):
    model: str | None = Field(None, description="served model name; may be omitted when only one is served")
    input: str | list[dict[str, Any]] | None = Field(
        None, description="a string (one user message) or a list of message, function_call and "
        "function_call_output items")
    instructions: str | None = Field(None, description="a system message put first; not carried to "
                                     "responses chained after this one")
    tools: list[dict[str, Any]] | None = Field(None, description="function tools only")
    tool_choice: str | dict[str, Any] | None = Field(None, description="none, auto, required or "
                                                     "{type: function, name}")
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    stream: bool = False
    background: bool = False
    user: str | None = Field(None, description="an end-user tag, for logs")
    safety_identifier: str | None = Field(None, description="an end-user tag, for logs")
    reasoning: Any = None
    include: Any = None
    truncation: Any = None
    service_tier: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    conversation: Any = None
    stream_options: Any = None
    context_management: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} keys")
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY or len(item) > MAX_METADATA_VALUE:
                raise ValueError(f"keys have at most {MAX_METADATA_KEY} characters and values "
                                 f"{MAX_METADATA_VALUE}")
        return value

    @model_validator(mode="after")
    def _no_ops_and_modes(self):
        for name, allowed in _NO_OP.items():
            value = getattr(self, name)
            if not any(value == ok and type(value) is type(ok) for ok in allowed):
                raise BadRequest(f"{name} is not supported by this server ({_WHY[name]})", param=name,
                                 code="unsupported_parameter")
        if self.input is None:
            raise BadRequest("missing required parameter: input", param="input", code="missing")
        if self.background and not self.store:
            raise BadRequest("background responses must be stored: store cannot be false with "
                             "background true", param="store")
        return self
