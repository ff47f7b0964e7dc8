"""An embeddings body -> one prompt of token ids per input, checked against the model: its
vocabulary, its length (cut where `truncate_prompt_tokens` asks, else a 400), `dimensions`
(a 400 unless the model declares Matryoshka sizes). Runs on the tokenizer thread."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from gateway.api.embeddings.schemas import EmbeddingRequest
from gateway.errors import BadRequest
from gateway.tokens.models import ServedModel
from shared.errors import ModelLoadError
from shared.pooling_config import PoolingConfig, read_pooling_config
from shared.pooling_params import PoolingParams


@dataclass
class EmbeddingPlan:
    model: ServedModel
    prompts: list[list[int]]  # per input, its token ids as they will be embedded
    pooling: PoolingParams
    encoding_format: str = "float"
    lora_name: str | None = None  # (always None: adapters serve no embeddings)
    api: ClassVar[str] = "embedding"

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))


@functools.lru_cache(maxsize=64)
def pooling_config(path: str) -> PoolingConfig:
    """The model folder's pooling (read once per folder)."""
    return read_pooling_config(path)


def _texts_or_ids(value) -> tuple[list[str] | None, list[list[int]] | None]:
    if isinstance(value, str):
        return [value], None
    if not value:
        raise BadRequest("input must not be empty", param="input")
    if isinstance(value[0], str):
        return value, None
    if isinstance(value[0], int):
        return None, [value]
    return None, value


def _encode(model: ServedModel, texts: list[str]) -> list[list[int]]:
    if any(not text for text in texts):
        index = next(i for i, text in enumerate(texts) if not text)
        raise BadRequest(f"input {index} is an empty string", param="input")
    backend = getattr(model.tokenizer, "backend_tokenizer", None)
    if backend is not None:  # one call for the whole list, the GIL released meanwhile
        return [encoding.ids for encoding in backend.encode_batch(texts)]
    return [model.encode_text(text, param="input") for text in texts]


def plan_embeddings(body: EmbeddingRequest, model: ServedModel, max_len: int | None = None) -> EmbeddingPlan:
    """The call's prompts; BadRequest naming the field at fault. `max_len`: the longest input
    the replicas take (default: the model's context window)."""
    try:
        config = pooling_config(model.path)
    except ModelLoadError as exc:
        raise BadRequest(f"the model {model.name!r} cannot make embeddings: {exc}", param="model") from None
    problem = config.check_dimensions(body.dimensions)
    if problem is not None:
        raise BadRequest(problem, param="dimensions")
    texts, ids = _texts_or_ids(body.input)
    prompts = _encode(model, texts) if texts is not None else [list(p) for p in ids]
    limit = max_len or model.context_window
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise BadRequest(f"input {index} is empty", param="input")
        bad = next((t for t in prompt if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"input {index}: token id {bad} is outside the vocabulary "
                             f"[0, {model.vocab_size})", param="input")
        if body.truncate_prompt_tokens is not None:
            if body.truncate_prompt_tokens > limit:
                raise BadRequest(f"truncate_prompt_tokens {body.truncate_prompt_tokens} is more than the "
                                 f"model's maximum context length of {limit} tokens",
                                 param="truncate_prompt_tokens")
            prompts[index] = prompt = prompt[-body.truncate_prompt_tokens:]
        if len(prompt) > limit:
            raise BadRequest(f"input {index} has {len(prompt)} tokens, more than the model's maximum context "
                             f"length of {limit} tokens; shorten it or set truncate_prompt_tokens",
                             param="input", code="context_length_exceeded")
    return EmbeddingPlan(model, prompts, PoolingParams(dimensions=body.dimensions), body.encoding_format)
