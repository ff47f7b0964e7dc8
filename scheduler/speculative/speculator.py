"""Which decodes carry drafts, how many, and what came of them (counters for the metrics).

A request speculates only when its sampling can be verified exactly by the workers'
acceptance rule (workers/spec_verify.py): no grammar (its mask would have to apply at every
proposed position), no logprobs or prompt logprobs (they would be reported per position), no
penalties (each position's history would differ), no seed (its random stream is indexed by
output position, which a verify step would have to reproduce). Such requests decode plainly,
in the same steps as the speculating ones.

Backoff:
- per step: no drafts while more than `disable_by_batch_size` requests run (a large batch is
  compute-bound, and a verify step's extra rows would cost more than they save);
- per request: of its last `_WINDOW` look-ups (a look-up that finds nothing counts as one with
  nothing accepted), when the drafted tokens accepted fall below `min_acceptance_rate`, it
  proposes nothing for its next `backoff_steps` output tokens, then tries again.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from scheduler.request import Request
from scheduler.speculative.proposers import Proposer, make_proposer
from shared.speculative import SpeculativeConfig

_WINDOW = 8  # look-ups a request's acceptance rate is judged over


def can_speculate(request: Request) -> bool:
    """Whether the request's sampling lets it speculate (the module docstring says why not)."""
    sampling = request.sampling
    return (sampling.grammar is None and sampling.logprobs is None and sampling.prompt_logprobs is None
            and not sampling.has_penalties and sampling.seed is None)


@dataclass
class _Track:
    """One request's recent look-ups: (drafted, accepted) each."""

    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_WINDOW))
    resume_at: int = 0  # backed off until the request has this many output tokens


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer = proposer or make_proposer(config)
        # Whether the proposer drafts for a whole step at once (a draft model's batched forward);
        # n-gram look-ups do not, and `prepare` is then never needed.
        self._propose_many = getattr(self.proposer, "propose_many", None)
        self._tracks: dict[str, _Track] = {}  # req_id -> its recent look-ups
        # Cumulative, as vLLM counts them: verify rows that carried drafts, drafted tokens,
        # accepted drafts (by position in the run), tokens emitted by those rows (accepted + 1,
        # less any cut by a stop or max_tokens).
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_emitted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * config.num_speculative_tokens
        self.num_backoffs = 0
        # Drafts proposed ahead for this step (prepare): req_id -> (its num_tokens then, drafts).
        self._prepared: dict[str, tuple[int, list[int]]] = {}

    def wants_to_speculate(self, request: Request) -> bool:
        """Eligible and not backed off: it proposes at its next decode with its token on the host."""
        if not can_speculate(request):
            return False
        track = self._tracks.get(request.req_id)
        return track is None or request.num_output_tokens >= track.resume_at

    def step_allows(self, num_running: int) -> bool:
        return num_running <= self.config.disable_by_batch_size

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """Drafts for the request's next decode (at most max_drafts and K); [] when it does not
        speculate now."""
        max_drafts = min(max_drafts, self.config.num_speculative_tokens)
        if max_drafts <= 0 or not self.wants_to_speculate(request):
            return []
        prepared = self._prepared.pop(request.req_id, None)
        if prepared is not None and prepared[0] == request.num_tokens:
            drafts = prepared[1][:max_drafts]  # a greedy run of K cut to m: the run of m
        else:
            drafts = self.proposer.propose(request.all_token_ids, max_drafts, req_id=request.req_id)
        if not drafts:
            self._note(request, 0, 0)
        return drafts

    @property
    def batches_proposals(self) -> bool:
        return self._propose_many is not None

    def prepare(self, requests: list[Request], max_drafts: list[int]) -> None:
        """Propose for a step's candidate decodes at once where the proposer batches (a draft
        model: one forward per draft position for all of them); `propose` then hands each its own,
        cut to what the step leaves it. A request not scheduled after all wasted its drafts."""
        self._prepared = {}
        if self._propose_many is None:
            return
        k = self.config.num_speculative_tokens
        items = [(r, min(m, k)) for r, m in zip(requests, max_drafts, strict=True)
                 if m > 0 and self.wants_to_speculate(r)]
        if items:
            proposed = self._propose_many([(r.req_id, r.all_token_ids, m) for r, m in items])
            self._prepared = {r.req_id: (r.num_tokens, d) for (r, _), d in zip(items, proposed, strict=True)}

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """What a verify row of `num_drafted` drafts kept (from update_from_output, which counts
        num_emitted_tokens itself: a stop may cut the run)."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1
        self._note(request, num_drafted, num_accepted)

    def _note(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        track = self._tracks.setdefault(request.req_id, _Track())
        track.recent.append((num_drafted, num_accepted))
        if len(track.recent) < _WINDOW:
            return
        drafted = sum(d for d, _ in track.recent)
        accepted = sum(a for _, a in track.recent)
        # A look-up that found nothing counts as K drafted, none accepted.
        drafted += self.config.num_speculative_tokens * sum(1 for d, _ in track.recent if d == 0)
        if accepted < self.config.min_acceptance_rate * drafted:
            track.recent.clear()
            track.resume_at = request.num_output_tokens + self.config.backoff_steps
            self.num_backoffs += 1

    def forget(self, req_id: str) -> None:
        self._tracks.pop(req_id, None)
        self.proposer.forget(req_id)

    def close(self) -> None:
        self.proposer.close()

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify row yields on average (vLLM's: 1 + accepted drafts per row)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
