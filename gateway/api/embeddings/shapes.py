"""The response of /v1/embeddings, for /openapi.json."""

from __future__ import annotations

from typing import Literal

from gateway.core.shapes import Shape


class Embedding(Shape):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (encoding_format)


class EmbeddingUsage(Shape):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Shape):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
