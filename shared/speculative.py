"""Speculative decoding's settings (`--speculative-config`), parsed and checked once.

Spelled as vLLM spells them, a JSON object:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

`method` names the proposer (scheduler/speculative/): "ngram" (prompt lookup: proposals copied
from the request's own tokens) and "draft_model" (a smaller model sharing the target's tokenizer,
`"model": PATH`; vLLM's `{"model": PATH}` without a method means it too) are built; the other
methods vLLM knows are refused as not built; anything else, or a key that is not below, is an
error naming it.

Keys that say when speculation backs off (docs/speculative-decoding.md):
- `disable_by_batch_size` (vLLM's key): no request speculates in a step while more than this many
  requests run (a large batch is compute-bound: verifying drafts would cost more than it saves);
- `min_speedup` and `min_acceptance_rate` (ours): a request whose recent look-ups are predicted
  to speed its steps up by less than `min_speedup` (scheduler/speculative/gain.py), or whose
  drafts were accepted at a lower rate, stops proposing; an n-gram request proposes again once
  the look-ups it would have made pass again, a draft model's after `backoff_steps` decodes
  (doubled at each consecutive back-off).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

METHODS = ("ngram", "draft_model")  # built
NOT_BUILT = ("eagle", "eagle3", "medusa", "mtp", "suffix")  # known, refused
NGRAM_KEYS = ("prompt_lookup_max", "prompt_lookup_min")  # the ngram method's own keys
DRAFT_MODEL_KEYS = ("model", "draft_tensor_parallel_size")  # the draft_model method's
MAX_SPECULATIVE_TOKENS = 16  # bounds a verify step's shape (and each request's wasted slots)


class SpeculativeConfigError(ValueError):
    """A --speculative-config that this engine cannot run; the message names the key."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # K: drafts proposed (and verified) per step, at most
    prompt_lookup_max: int = 4  # longest suffix n-gram looked up in the request's tokens
    prompt_lookup_min: int = 2  # shortest
    disable_by_batch_size: int = 16  # no speculation in a step while more requests than this run
    min_acceptance_rate: float = 0.2  # a request's recent acceptance below this: it backs off
    # A request's recent look-ups predicted to speed its steps up by less than this (the
    # expected-gain rule, scheduler/speculative/gain.py): it backs off. 0: never on this ground.
    min_speedup: float = 1.2
    backoff_steps: int = 16  # draft_model: decodes a backed-off request makes before it tries again
    model: str | None = None  # draft_model: the draft's Hugging Face folder (required there only)
    draft_tensor_parallel_size: int = 1  # vLLM's key; the draft runs unsharded, in the engine's process

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            if self.method in NOT_BUILT:
                raise SpeculativeConfigError(
                    f"speculative method {self.method!r} is not built in this engine; "
                    f"use one of {list(METHODS)}")
            raise SpeculativeConfigError(
                f"unknown speculative method {self.method!r}; choose one of {list(METHODS)}")
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                    "disable_by_batch_size", "backoff_steps"):
            value, least = getattr(self, key), 0 if key == "backoff_steps" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise SpeculativeConfigError(f"{key} must be an integer >= {least}, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(
                f"num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpeculativeConfigError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise SpeculativeConfigError(
                'method "draft_model" needs "model": the folder of a draft model sharing the target\'s '
                "tokenizer")
        if self.method != "draft_model" and self.model is not None:
            raise SpeculativeConfigError(f'"model" is the draft_model method\'s key, not {self.method!r}\'s')
        if self.draft_tensor_parallel_size != 1:
            raise SpeculativeConfigError(
                f"draft_tensor_parallel_size must be 1 (the draft runs unsharded), "
                f"got {self.draft_tensor_parallel_size!r}")
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
            raise SpeculativeConfigError(f"min_acceptance_rate must be a number in [0, 1], got {rate!r}")
        gain = self.min_speedup
        if isinstance(gain, bool) or not isinstance(gain, int | float) or not 0 <= gain <= 100:
            raise SpeculativeConfigError(f"min_speedup must be a number in [0, 100], got {gain!r}")

    def __str__(self) -> str:
        """The JSON that parse_speculative_config reads back (a scheduler's command line)."""
        fields = asdict(self)
        for key in NGRAM_KEYS if self.method != "ngram" else DRAFT_MODEL_KEYS:
            del fields[key]  # another method's keys (the parser refuses them)
        return json.dumps(fields, separators=(",", ":"))


def parse_speculative_config(text: str | dict) -> SpeculativeConfig:
    """The config of a JSON object (text or parsed); SpeculativeConfigError naming what is wrong."""
    if isinstance(text, str):
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpeculativeConfigError(f"--speculative-config is not JSON: {exc}") from None
    else:
        fields = dict(text)
    if not isinstance(fields, dict):
        raise SpeculativeConfigError("--speculative-config must be a JSON object")
    if "method" not in fields and "model" in fields:
        fields["method"] = "draft_model"  # vLLM's reading of a model without a method
    if "method" not in fields:
        raise SpeculativeConfigError('--speculative-config needs a "method" (e.g. "ngram")')
    method = fields["method"]
    if method in NOT_BUILT or method not in METHODS:
        SpeculativeConfig(method=method)  # raises the method's error
    known = set(SpeculativeConfig.__dataclass_fields__)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise SpeculativeConfigError(
            f"unknown key {unknown[0]!r} in --speculative-config; known keys: {sorted(known)}")
    if method == "draft_model":
        given = [key for key in NGRAM_KEYS if key in fields]
        if given:
            raise SpeculativeConfigError(
                f"{given[0]!r} is the ngram method's key; draft_model does not look up")
    # One lookup bound given alone: the other default is moved so that min <= max still holds.
    lo, hi = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
    if isinstance(hi, int) and lo is None:
        fields["prompt_lookup_min"] = min(hi, SpeculativeConfig.prompt_lookup_min)
    if isinstance(lo, int) and hi is None:
        fields["prompt_lookup_max"] = max(lo, SpeculativeConfig.prompt_lookup_max)
    return SpeculativeConfig(**fields)
