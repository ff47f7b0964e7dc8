"""Draft proposers: given a request's tokens, guess the next few.

Only the interface and n-gram prompt lookup are built. A proposer that needs a model (a draft
model with its own KV cache, EAGLE-style heads on the target's hidden states) would run on the
workers; it would still answer `propose` here, from what the previous step returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from shared.speculative import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens guessed to follow `token_ids` (prompt + output); [] for none."""
        ...


class NgramProposer:
    """Prompt lookup: find the longest suffix of the tokens (prompt_lookup_max down to
    prompt_lookup_min long) that occurred earlier in them, and propose what followed it there.
    Among equally long matches the most recent wins: in a rewrite or a code edit the copy moves
    forward through its source, and the latest occurrence is the one being copied.

    Cost per call: one vectorised pass over the tokens for the last token's earlier occurrences,
    then prompt_lookup_max - 1 passes over those candidates only."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        num_tokens = len(token_ids)
        if max_drafts <= 0 or num_tokens <= self.min_n:
            return []
        tokens = np.fromiter(token_ids, dtype=np.int64, count=num_tokens)
        last = num_tokens - 1
        # ends: where an earlier n-gram would end (before the last token, so one token follows it)
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        if not ends.size:
            return []
        length = np.ones(ends.size, dtype=np.int64)  # matched length, backwards from each end
        alive = np.ones(ends.size, dtype=bool)
        for k in range(1, min(self.max_n, last + 1)):
            at = ends - k
            alive &= (at >= 0) & (tokens[np.maximum(at, 0)] == tokens[last - k])
            length += alive
        best = int(length.max())
        if best < self.min_n:
            return []
        end = int(ends[np.flatnonzero(length == best)[-1]])  # the most recent of the longest
        return tokens[end + 1 : end + 1 + max_drafts].tolist()


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"no proposer for method {config.method!r}")  # SpeculativeConfig refuses these first
