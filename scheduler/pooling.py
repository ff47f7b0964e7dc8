"""The engine's side of `--runner pooling`: which requests pool, and their outputs as embeddings.

A pooling request is a prompt that ends after its prefill: the scheduler plans it like any
other (chunks under the step budget, blocks, priorities, tenants, preemption) with SamplingParams
that ask for one token; the pooling runner returns its vector with a placeholder token in that
token's place. Here the finished output drops the placeholder and carries the embedding, cut to
the request's `dimensions`. Prefix caching is off (mean and CLS pooling need every row computed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler.request import FinishReason
from scheduler.step_plan import RequestOutput
from shared.config import EngineConfig
from shared.errors import InvalidRequestError, ModelLoadError
from shared.model_config import ModelConfig
from shared.pooling_config import PoolingConfig, read_pooling_config
from shared.pooling_params import (
    POOLING_SAMPLING,
    RUNNERS,
    PoolingParams,
    embedding_from_bytes,
    finish_embedding,
)


@dataclass
class EmbeddingResult:
    req_id: str
    embedding: np.ndarray  # float32 [dimensions or hidden_size]
    num_prompt_tokens: int


def check_runner(config: EngineConfig, model_config: ModelConfig) -> None:
    """Refuse a runner the model or the other settings cannot go with, by name."""
    if config.runner not in RUNNERS:
        raise ModelLoadError(f"unknown runner {config.runner!r}; choose one of {', '.join(RUNNERS)}")
    if config.runner == "generate":
        if model_config.is_encoder:
            raise ModelLoadError(f"{config.model!r} is an encoder ({model_config.model_type}): it makes "
                                 "embeddings, not text; serve it with --runner pooling")
        return
    refused = [name for name, is_set in (
        ("--enable-lora", config.enable_lora),
        ("--speculative-config", config.speculative_config is not None),
        ("--quantization", config.quantization is not None),
        ("--kv-cache-dtype fp8", config.kv_cache_dtype != "auto"),
        ("--kv-offloading-size", config.kv_offloading_size > 0),
        ("--pp > 1", config.pp > 1)) if is_set]
    if refused:
        raise ModelLoadError(f"--runner pooling does not run with {', '.join(refused)}")


def wrong_runner_error(runner: str, wants_pooling: bool) -> InvalidRequestError:
    """The 400 of a request the engine's runner does not serve."""
    if wants_pooling:
        return InvalidRequestError(f"this model runs with --runner {runner}: it does not serve embeddings "
                                   "(start it with --runner pooling)", param="model")
    return InvalidRequestError(f"this model runs with --runner {runner}: it serves embeddings only, "
                               "not text generation", param="model")


class PoolingRequests:
    """The pooling requests of one engine (req_id -> its params) until they end."""

    def __init__(self, model: str) -> None:
        self.config: PoolingConfig = read_pooling_config(model)
        self._params: dict[str, PoolingParams] = {}

    def add(self, req_id: str, params: PoolingParams) -> None:
        if params.task != "embed":
            raise InvalidRequestError(f"pooling task {params.task!r} is not served (only embed)",
                                      param="task")
        problem = self.config.check_dimensions(params.dimensions)
        if problem is not None:
            raise InvalidRequestError(problem, param="dimensions")
        self._params[req_id] = params

    def forget(self, req_id: str) -> None:
        self._params.pop(req_id, None)

    def finish_outputs(self, outputs: list[RequestOutput], pooled: dict[str, bytes]) -> None:
        """Turn the outputs of pooling requests into embeddings (in place)."""
        for out in outputs:
            params = self._params.get(out.req_id)
            if params is None:
                continue
            if out.finished:
                del self._params[out.req_id]
            raw = pooled.get(out.req_id)
            if raw is None:
                continue  # (an abort: no vector)
            out.embedding = finish_embedding(raw, params.dimensions, self.config.normalize)
            out.new_token_ids, out.text_delta, out.logprobs = [], "", None
            out.finish_reason, out.stop_reason = FinishReason.STOP, None


def embed_all(engine, prompts: list[str | list[int]], params: PoolingParams,
              truncate_prompt_tokens: int | None) -> list[EmbeddingResult]:
    """LLMEngine.embed: every prompt added, stepped until all are embedded, in prompt order."""
    order: list[tuple[str, int]] = []
    for prompt in prompts:
        ids = list(prompt) if isinstance(prompt, list) else engine.encode(prompt)
        if truncate_prompt_tokens is not None:
            ids = ids[-truncate_prompt_tokens:]
        order.append((engine.add_request(ids, POOLING_SAMPLING, pooling=params), len(ids)))
    vectors: dict[str, bytes] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.embedding is not None:
                vectors[out.req_id] = out.embedding
    return [EmbeddingResult(req_id, embedding_from_bytes(vectors[req_id]).copy(), n) for req_id, n in order]
