"""Draft proposers: given a request's tokens, guess the next few.

The interface and n-gram prompt lookup are here; the draft model's proposer, which keeps a KV
cache per request (hence `req_id` and `forget`), is draft_model.py. EAGLE-style heads on the
target's hidden states would need the workers' step to return those states: not built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from shared.speculative import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], max_drafts: int, req_id: str = "") -> list[int]:
        """Up to `max_drafts` tokens guessed to follow `token_ids` (prompt + output) of the request
        `req_id`; [] for none. Drafts must be a deterministic function of the tokens (greedy): the
        sampled rows' acceptance rule takes the proposal as a point mass (workers/spec_verify.py)."""
        ...

    def forget(self, req_id: str) -> None:
        """The request finished: whatever the proposer kept for it goes."""
        ...

    def close(self) -> None:
        """Give back what the proposer holds (a draft model's weights and KV cache)."""
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

    def forget(self, req_id: str) -> None:
        pass  # nothing is kept per request

    def close(self) -> None:
        pass

    def propose(self, token_ids: Sequence[int], max_drafts: int, req_id: str = "") -> list[int]:
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
    """The proposer that needs no model; a draft model's is built by the engine (draft_model.py),
    which knows the target and the device, and handed to the scheduler."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"the {config.method!r} proposer is built by the engine (build_draft_proposer), "
                     "and given to the Scheduler")
