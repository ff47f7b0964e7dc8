"""Qwen (v1) past its training context `seq_length`: logn attention and dynamic NTK, as numbers.

- logn attention: the query of the i-th token (i counted from 1, so position i - 1) is scaled
  by log(i) / log(seq_length) when i > seq_length, which keeps attention's entropy from
  spreading as the context grows.
- dynamic NTK: a prompt of L tokens runs with the rotary base raised by alpha^(d / (d - 2))
  (d: the rotated dims), alpha = 2^ceil(log2(L / seq_length) + 1) - 1, at least 1. alpha is
  fixed at prefill by the prompt's length and kept while the sequence decodes, so it is a
  property of the request, not of the step.

alpha takes few values (1, 3, 7, 15, ...: the "variant" 0, 1, 2, 3, ...). The model holds one
rotary table per variant, stacked, and a sequence reads its rows at `position + rope_offset`
with rope_offset = variant * the table's stride (the engine's max_model_len). The scheduler
and the runners only add that offset; what it means lives here and in workers/models/qwen.py.

Here, below the engine and the workers both, because the engine picks a request's offset and
the model builds the tables it indexes.
"""

from __future__ import annotations

import math


def ntk_alpha(prompt_len: int, seq_length: int) -> int:
    """alpha for a prompt of `prompt_len` tokens (1: inside the training context)."""
    context_value = math.log2(prompt_len / seq_length) + 1
    return max(2 ** math.ceil(context_value) - 1, 1)


def ntk_variant(prompt_len: int, seq_length: int) -> int:
    """Which stacked rotary table the prompt uses: log2(alpha + 1) - 1 (0 for alpha 1)."""
    return ntk_alpha(prompt_len, seq_length).bit_length() - 1


def num_ntk_variants(max_len: int, seq_length: int) -> int:
    """Tables needed so that every prompt of up to `max_len` tokens has its own."""
    return ntk_variant(max(max_len, 1), seq_length) + 1


def variant_alpha(variant: int) -> int:
    return 2 ** (variant + 1) - 1


def ntk_base(base: float, alpha: float, rotary_dim: int) -> float:
    """The raised rotary base: base * alpha^(d / (d - 2))."""
    return base * alpha ** (rotary_dim / (rotary_dim - 2))


def logn_scale(position: int, seq_length: int) -> float:
    """The query scale at 0-based `position` (the token i = position + 1)."""
    i = position + 1
    return math.log(i) / math.log(seq_length) if i > seq_length else 1.0


def rope_offset(prompt_len: int, *, seq_length: int | None, use_dynamic_ntk: bool, stride: int) -> int:
    """The row offset of a request's rotary table (0 unless dynamic NTK raises its base)."""
    if not use_dynamic_ntk or not seq_length:
        return 0
    return ntk_variant(prompt_len, seq_length) * stride
