"""Sampling parameters of one request, validated once at the edge."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from shared.errors import InvalidRequestError

# Cap on top-N logprobs, as in OpenAI's API (top_logprobs <= 20).
MAX_TOP_LOGPROBS = 20

# What a grammar spec (SamplingParams.grammar, a JSON text) may ask for; the scheduler compiles
# it (scheduler/grammar.py): any JSON value, one matching a JSON schema, or an xgrammar
# structural tag (tool calls in a model's own format).
GRAMMAR_TYPES = ("json_object", "json_schema", "structural_tag")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int | None = None  # None: no top-k cut
    min_p: float = 0.0  # in [0, 1]
    seed: int | None = None  # makes sampling reproducible per request
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0  # OpenAI semantics, over generated tokens
    frequency_penalty: float = 0.0  # OpenAI semantics, over generated tokens
    repetition_penalty: float = 1.0  # HF/CTRL semantics, over prompt + generated tokens
    logprobs: int | None = None  # None: none; 0: the chosen token's; N: also the top N
    ignore_eos: bool = False
    # Logprobs of the prompt's own tokens (each given the ones before it; the first has none),
    # computed from the prefill's logits: None: none; 0: each token's; N: also the top N.
    # Such a request does not start from the prefix cache (cached positions have no logits).
    prompt_logprobs: int | None = None
    # Grammar-constrained decoding: a JSON text {"type": one of GRAMMAR_TYPES, ...}; None: free.
    # Read by the scheduler only: the workers get the token mask it computes (StepBatch.token_mask),
    # and a copy of the params without it (Request.worker_sampling).
    grammar: str | None = None

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> SamplingParams:
        """Raise InvalidRequestError naming the first bad field; return self when fine."""

        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param=param)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (
            not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1
        ):
            raise bad("top_k", f"top_k must be an integer >= 1 (or absent), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "stop must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "stop_token_ids must be a list of non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty!r}",
            )
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int)
            or isinstance(self.logprobs, bool)
            or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise bad("logprobs", f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int)
            or isinstance(self.prompt_logprobs, bool)
            or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise bad("prompt_logprobs",
                      f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if self.grammar is not None:
            _check_grammar(self.grammar)
        return self


def _check_grammar(grammar: object) -> None:
    """The spec's shape only; whether its schema compiles is the scheduler's to say."""
    message = None
    try:
        spec = json.loads(grammar) if isinstance(grammar, str) else None
    except ValueError:
        spec = None
    if not isinstance(spec, dict):
        message = "grammar must be the JSON text of an object"
    elif spec.get("type") not in GRAMMAR_TYPES:
        message = f"grammar type must be one of {list(GRAMMAR_TYPES)}, got {spec.get('type')!r}"
    if message is not None:
        raise InvalidRequestError(message, param="response_format")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
