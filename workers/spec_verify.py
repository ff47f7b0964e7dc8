"""Speculative decoding's verification: the target scores every proposed token in one forward.

A work with k drafts (SequenceWork.num_draft_tokens) computes [last known token, d1 .. dk] at
positions p .. p+k, as a prefill chunk does. The hidden state at p+i predicts the token at
p+i+1, so its first k rows score d1 .. dk, and its last row (sampled like any work's last row,
by the sampler) gives the token after dk.

Acceptance, row by row, stopping at the first rejected draft:
- a greedy row accepts its draft when it is the row's argmax; the first mismatch is replaced by
  that argmax. The tokens emitted are exactly the target's greedy decode.
- a random row runs speculative sampling's rule for a proposal that is a point mass q = 1[d]
  (no draft is sampled: n-gram drafts are copied, a draft model's are its argmax, both
  deterministic given the request's tokens, so the point mass is their exact proposal): accept
  d with probability min(1, p(d) / q(d)) = p(d), where
  p is the row's distribution as the sampler makes it (temperature, top-k, top-p, min-p); on
  rejection draw from normalize(max(0, p - q)), which is p with d taken out. Each token emitted is
  then distributed as plain sampling would have drawn it.
If every draft is accepted, the last row's sampled token follows them (the "bonus" token).

The rows are scored on the device, for every draft at once (accepted flag, and the replacement a
rejection would take); the host keeps the leading accepted run of each work (`apply`).
Requests with penalties, logprobs or a seed never carry drafts (scheduler/speculative/
speculator.py), so neither rule needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from shared.step import SampledToken, SequenceWork
from workers.sampler import Sampler, is_random, processed_probs
from workers.step_inputs import eager_order

Upload = Callable[[np.ndarray], torch.Tensor]  # int64 host array -> a device tensor


def wanted(works: list[SequenceWork]) -> bool:
    return any(w.num_draft_tokens for w in works)


def draft_rows(works: list[SequenceWork]) -> list[int]:
    """The eager step's rows that score the drafts: per work with drafts, in batch order, the k
    rows before its last."""
    offsets: dict[int, int] = {}
    offset = 0
    for i in eager_order(works):
        offsets[i] = offset
        offset += len(works[i].token_ids)
    rows: list[int] = []
    for i, work in enumerate(works):
        if work.num_draft_tokens:
            rows += range(offsets[i], offsets[i] + work.num_draft_tokens)
    return rows


def draft_logits(compute_logits, hidden: torch.Tensor, works: list[SequenceWork],
                 upload: Upload) -> torch.Tensor:
    """[num_drafts, vocab]: the logits that score the step's drafts, from the eager step's hidden
    states. Every rank of the last stage calls this (compute_logits may be collective). upload:
    the runner's HostStaging.upload (a plain copy from host memory would wait for the forward)."""
    rows = upload(np.array(draft_rows(works), dtype=np.int64))
    return compute_logits(hidden[rows])


def residual_probs(probs: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) for the point mass q at each row's draft ([rows, 1]): p with the draft's
    mass taken out, unnormalized (the draw below needs no normalizing)."""
    return probs.scatter(1, drafts, 0.0)


@dataclass
class DeviceVerify:
    """A step's verification, on the device until `apply` reads it."""

    works: list[SequenceWork]  # the works with drafts, in batch order
    is_accepted: torch.Tensor  # [num_drafts] bool, the works' drafts concatenated
    replacement_ids: torch.Tensor  # [num_drafts] long: the token a rejection at that row emits


def verify(logits: torch.Tensor, works: list[SequenceWork], sampler: Sampler,
           upload: Upload) -> DeviceVerify:
    """Score every draft of the step (logits: draft_logits'; upload: the runner's
    HostStaging.upload). Nothing here waits for the device."""
    spec_works = [w for w in works if w.num_draft_tokens]
    device = logits.device
    drafts = upload(np.array([t for w in spec_works for t in w.token_ids[-w.num_draft_tokens:]],
                             dtype=np.int64))
    row_works = [w for w in spec_works for _ in range(w.num_draft_tokens)]
    argmax = logits.argmax(dim=-1)
    is_accepted = argmax == drafts
    replacement_ids = argmax
    random_rows = [i for i, w in enumerate(row_works) if is_random(w.sampling)]
    if random_rows:
        index = upload(np.array(random_rows, dtype=np.int64))
        probs = processed_probs(logits[index].float(), [row_works[i].sampling for i in random_rows])
        probs = probs / probs.sum(dim=-1, keepdim=True)  # [num_random, vocab]
        row_drafts = drafts[index].unsqueeze(1)
        generator = sampler.random_generator(device)
        uniform = torch.rand(len(random_rows), device=device, generator=generator)
        is_accepted[index] = uniform < probs.gather(1, row_drafts).squeeze(1)
        residual = residual_probs(probs, row_drafts)
        noise = torch.empty_like(residual).exponential_(generator=generator).clamp_min_(
            torch.finfo(residual.dtype).tiny)
        replacement_ids = argmax.clone()
        replacement_ids[index] = (residual / noise).argmax(dim=-1)  # a draw from normalize(residual)
    return DeviceVerify(spec_works, is_accepted, replacement_ids)


def apply(tokens: list[SampledToken], verified: DeviceVerify) -> None:
    """Turn each speculating work's sampled token (its last row's) into the verify's outcome:
    num_accepted_drafts, and token_id the replacement at the first rejected draft (unchanged
    when every draft was accepted). Waits for the device."""
    is_accepted = verified.is_accepted.tolist()
    replacement_ids = verified.replacement_ids.tolist()
    outcome: dict[str, tuple[int, int | None]] = {}  # req_id -> (accepted drafts, replacement)
    row = 0
    for work in verified.works:
        k = work.num_draft_tokens
        num_accepted = next((i for i in range(k) if not is_accepted[row + i]), k)
        replacement = replacement_ids[row + num_accepted] if num_accepted < k else None
        outcome[work.req_id] = (num_accepted, replacement)
        row += k
    for token in tokens:
        if token.req_id in outcome:
            token.num_accepted_drafts, replacement = outcome[token.req_id]
            if replacement is not None:
                token.token_id = replacement
