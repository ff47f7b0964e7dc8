"""The body of POST /v1/embeddings (OpenAI's, with vLLM's `truncate_prompt_tokens`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from gateway.api.openai import bounds
from gateway.core.shapes import StrictModel

MAX_INPUTS = 2048  # inputs of one call, as OpenAI
MAX_INPUT_TOKEN_IDS = 1 << 18  # one input given as ids: past any context window served

TokenIds = list[int]


class EmbeddingRequest(StrictModel):
    model: str | None = Field(None, max_length=bounds.MAX_NAME_CHARS,
                              description="served model name; may be omitted when only one is served")
    input: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="a text, a list of texts, a list of token ids, or a list of such lists")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: little-endian float32 bytes "
                             "(the openai SDK's default)")
    dimensions: int | None = Field(None, ge=1, description="cut each embedding to this many dimensions "
                                                           "(models that declare Matryoshka sizes)")
    user: str | None = Field(None, max_length=bounds.MAX_NAME_CHARS)
    truncate_prompt_tokens: int | None = Field(
        None, ge=1, description="vLLM's: keep each input's last N tokens instead of refusing a long one")

    @field_validator("input")
    @classmethod
    def _bounded(cls, value):
        if isinstance(value, str) or not value:
            return value
        if len(value) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs per call, got {len(value)}")
        if isinstance(value[0], list) and any(len(ids) > MAX_INPUT_TOKEN_IDS for ids in value):
            raise ValueError(f"an input of token ids holds at most {MAX_INPUT_TOKEN_IDS} ids")
        if isinstance(value[0], int) and len(value) > MAX_INPUT_TOKEN_IDS:
            raise ValueError(f"an input of token ids holds at most {MAX_INPUT_TOKEN_IDS} ids")
        return value
