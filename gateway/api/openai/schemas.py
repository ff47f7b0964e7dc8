"""Request bodies, validated by pydantic v2 (strict: no "5" for 5) and described in /openapi.json.

Every OpenAI parameter we run is declared; a parameter we do not run is either absent (an
unknown field is rejected by extra="forbid") or declared so that only its no-op value is
accepted (`tools: []`, `logit_bias: {}`...), so nothing a client asks for is silently ignored.
Cross-field rules raise BadRequest (which pydantic lets through) to name their field.
Every list- and string-valued field has a bound (gateway/api/openai/bounds.py): past it, a 400
naming the field. Rules that need the model (context window, vocabulary) live in
gateway/api/openai/params.py.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from gateway.api.openai import bounds
from gateway.core.shapes import StrictModel
from gateway.errors import BadRequest
from shared.sampling import MAX_TOP_LOGPROBS

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Name = Annotated[str, Field(max_length=bounds.MAX_NAME_CHARS)]
Description = Annotated[str, Field(max_length=bounds.MAX_DESCRIPTION_CHARS)]


class StreamOptions(StrictModel):
    include_usage: bool = False
    # vLLM's: the usage so far on every chunk (load tools read each request's token count from it).
    continuous_usage_stats: bool = False


def _check_schema_size(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """A JSON schema of at most bounds.MAX_SCHEMA_BYTES (as compact JSON): the scheduler
    compiles it into a grammar, which a huge one would keep busy."""
    if value is not None:
        size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
        if size > bounds.MAX_SCHEMA_BYTES:
            raise ValueError(f"the schema is {size} bytes as JSON, more than the {bounds.MAX_SCHEMA_BYTES} "
                             "this server takes")
    return value


def _only_default(name: str, value: Any, allowed: tuple = (None,)) -> Any:
    """A parameter we accept only with the value that asks for nothing."""
    if value in allowed or value == {} or value == []:
        return value
    raise ValueError(f"{name} is not supported by this server")


class SamplingFields(StrictModel):
    """What /v1/completions and /v1/chat/completions share."""

    model: Name | None = Field(None, description="served model name; may be omitted when only one is served")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=bounds.MAX_N,
                   description="choices to generate (capped by the gateway's --max-n)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(
        None, description=f"up to {bounds.MAX_STOP_STRINGS} strings of up to {bounds.MAX_STOP_STRING_CHARS} "
        "characters; the text ends before them")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, description="only {} (not supported)",
                                                json_schema_extra={"maxProperties": 0})
    user: Name | None = Field(None, description="an end-user tag (accepted, not used)")
    # Extras that vLLM users know.
    top_k: int | None = Field(None, ge=-1, le=bounds.MAX_TOP_K, description="-1 or 0: no top-k cut")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, max_length=bounds.MAX_STOP_TOKEN_IDS,
        description="token ids that end a choice (not in its text)")
    priority: int = Field(0, ge=-(2**31), lt=2**31, description="lower runs first")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                        description="vLLM's: each prompt token's logprob and the top N")

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if len(strings) > bounds.MAX_STOP_STRINGS:
            raise ValueError(f"at most {bounds.MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        if any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > bounds.MAX_STOP_STRING_CHARS for s in strings):
            raise ValueError(f"a stop string may have at most {bounds.MAX_STOP_STRING_CHARS} characters")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict | None) -> dict | None:
        return _only_default("logit_bias", value)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise BadRequest("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: Name = Field(min_length=1)
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(StrictModel):
    id: Name
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        description="null or absent only in an assistant message with tool_calls; at most "
        f"{bounds.MAX_CONTENT_PARTS} text parts")
    name: Name | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=bounds.MAX_TOOL_CALLS,
                                              description="an assistant's earlier calls")
    tool_call_id: Name | None = Field(None, description="a tool message: the call it answers")
    # What the SDK's message.model_dump() echoes back from a reply: accepted as null (an answer
    # of ours never has them); a value we would have to honour is a 400 naming it.
    refusal: str | None = Field(None, description="only null", json_schema_extra={"maxLength": 0})
    audio: dict[str, Any] | None = Field(None, description="only null",
                                         json_schema_extra={"maxProperties": 0})
    function_call: dict[str, Any] | None = Field(None, description="only null (deprecated: use tool_calls)",
                                                 json_schema_extra={"maxProperties": 0})
    annotations: list[Any] | None = Field(None, description="only null", json_schema_extra={"maxItems": 0})

    @field_validator("refusal", "audio", "function_call", "annotations")
    @classmethod
    def _echoed_nulls(cls, value: Any, info) -> Any:
        return _only_default(info.field_name, value, (None, ""))

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            if len(data["content"]) > bounds.MAX_CONTENT_PARTS:
                raise ValueError(f"content has {len(data['content'])} parts, more than "
                                 f"{bounds.MAX_CONTENT_PARTS}")
            for part in data["content"]:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"content part of type {kind!r} is not supported; only 'text'")
        if isinstance(data, dict) and data.get("tool_calls") and "content" not in data:
            data = {**data, "content": None}  # OpenAI lets an assistant's call go without content
        return data

    @model_validator(mode="after")
    def _roles_fields(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only for an assistant message with tool_calls)")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Description | None = None
    # "schema" shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON schema")
    strict: bool | None = None

    _schema_size = field_validator("schema_")(_check_schema_size)


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise BadRequest("response_format.json_schema is required with type json_schema, and only "
                             "then", param="response_format.json_schema")
        return self


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: Description | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = None

    _schema_size = field_validator("parameters")(_check_schema_size)


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: Name


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=bounds.MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, description="deprecated name of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=bounds.MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without")
    functions: list[dict[str, Any]] | None = Field(None, description="only [] (deprecated: use tools)",
                                                   json_schema_extra={"maxItems": 0})
    function_call: Literal["none"] | None = None
    parallel_tool_calls: bool | None = Field(None, description="default true: several calls in one answer")

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, value: list | None, info) -> list | None:
        return _only_default(info.field_name, value)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        return self


PromptType = Annotated[
    str | list[Annotated[int, Field(ge=0)]] | list[str] | list[list[Annotated[int, Field(ge=0)]]],
    Field(description="a string, a list of token ids, or a list of up to "
          f"{bounds.MAX_PROMPTS} of either (one choice set each)"),
]


class CompletionRequest(SamplingFields):
    prompt: PromptType
    max_tokens: int = Field(16, ge=0, description="0 only with echo: the prompt alone")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="top-N logprobs per token")
    echo: bool = Field(False, description="prepend the prompt text to each choice's text (and, with "
                       "logprobs, the prompt tokens' logprobs to its logprobs)")
    best_of: int | None = Field(None, ge=1, description="only equal to n (no server-side ranking)")
    suffix: str | None = Field(None, description="not supported: only null")

    @field_validator("prompt")
    @classmethod
    def _few_prompts(cls, value: str | list) -> str | list:
        is_list_of_prompts = isinstance(value, list) and bool(value) and not isinstance(value[0], int)
        if is_list_of_prompts and len(value) > bounds.MAX_PROMPTS:
            raise ValueError(f"at most {bounds.MAX_PROMPTS} prompts per request, got {len(value)}")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        return _only_default("suffix", value, (None, ""))

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest("best_of must equal n (choices are not ranked on the server)", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest("max_tokens must be at least 1 (0 only with echo: the prompt alone)",
                             param="max_tokens")
        return self
