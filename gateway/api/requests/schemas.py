"""The body of POST /v1/requests: a chat, a completion or an embedding body (the OpenAI API's own,
with its checks) tagged by `kind`, plus when it expires if still queued."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from gateway.api.embeddings.schemas import EmbeddingRequest
from gateway.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.core.shapes import StrictModel


class SubmitFields(StrictModel):
    deadline: float | None = Field(None, description="unix time; expires if still queued after it")
    timeout: float | None = Field(None, gt=0, description="seconds from now; sets the deadline")


class SubmitChat(ChatCompletionRequest, SubmitFields):
    kind: Literal["chat"]


class SubmitCompletion(CompletionRequest, SubmitFields):
    kind: Literal["completion"]


class SubmitEmbedding(EmbeddingRequest, SubmitFields):
    kind: Literal["embedding"]


SubmitRequest = Annotated[SubmitChat | SubmitCompletion | SubmitEmbedding, Field(discriminator="kind")]
