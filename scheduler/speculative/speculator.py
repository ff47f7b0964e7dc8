"""Which decodes carry drafts, how many, and what came of them (counters for the metrics).

A request speculates only when its sampling can be verified exactly by the workers'
acceptance rule (workers/spec_verify.py): no grammar (its mask would have to apply at every
proposed position), no logprobs or prompt logprobs (they would be reported per position), no
penalties (each position's history would differ), no seed (its random stream is indexed by
output position, which a verify step would have to reproduce). Such requests decode plainly,
in the same steps as the speculating ones.

Backing off:
- per step: no drafts while more than `disable_by_batch_size` requests run (a large batch is
  compute-bound, and a verify step's extra rows would cost more than they save);
- per request: its last `_WINDOW` look-ups (a look-up that finds nothing counts as one with
  nothing accepted) are priced by the expected-gain rule (gain.py) with the step cost model;
  where the predicted speedup is below `min_speedup`, or the drafts accepted below
  `min_acceptance_rate`, the request stops proposing. Judged at every look-up from the
  `_MIN_JUDGED`th on: a window not full yet as if its other look-ups were all its best one, so a
  request whose first look-ups find nothing stops after three, not eight.

A request that stopped decodes plainly, and under async scheduling no longer holds the engine
back. Its way back depends on the proposer:
- n-gram (host-only, deterministic): the look-ups it would have made go on on the host, scored
  against the tokens the model then produced ("shadow" look-ups: the drafts at position p are
  the lookup in the tokens before p, accepted as far as they match the tokens from p on, which
  is exactly what greedy verification accepts, and for sampled rows what a point-mass proposal
  accepts on average). It proposes again as soon as its recent look-ups pass the rule;
- a draft model (each look-up a forward of the draft): it waits `backoff_steps` output tokens,
  doubled at each consecutive back-off (at most 16 times), then speculates for a window again.

An n-gram request whose next look-up cannot find anything does not want to speculate in that
step either (`_may_find`): it is scheduled ahead like a request that cannot speculate.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.request import Request
from scheduler.speculative.gain import StepMs, predicted_speedup
from scheduler.speculative.proposers import NgramProposer, Proposer, make_proposer
from scheduler.step_cost import StepCost
from shared.speculative import SpeculativeConfig

_WINDOW = 8  # look-ups a request's acceptance and gain are judged over
_MIN_JUDGED = 3  # look-ups before the first judgment (the window then completed by its best)
_MAX_BACKOFF_DOUBLINGS = 4  # a draft model's back-off grows to 16 x backoff_steps at most


def can_speculate(request: Request) -> bool:
    """Whether the request's sampling lets it speculate (the module docstring says why not)."""
    sampling = request.sampling
    return (sampling.grammar is None and sampling.logprobs is None and sampling.prompt_logprobs is None
            and not sampling.has_penalties and sampling.seed is None)


@dataclass
class _Track:
    """One request's recent look-ups, (drafted, accepted) each, and whether it proposes now."""

    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_WINDOW))
    is_on: bool = True
    resume_at: int = 0  # a draft model's, backed off: until the request has this many output tokens
    num_backoffs: int = 0  # consecutive back-offs (a draft model's grows with them)
    shadow_at: int = 0  # n-gram, backed off: the token count of the next shadow look-up


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None, *,
                 step_cost: Callable[[], StepCost] | None = None, gives_up_async: bool = False) -> None:
        """step_cost: the scheduler's step cost model (a getter), which prices look-ups
        (gain.py) once it has timed steps of two sizes; None: the proportions of one H100 run.
        gives_up_async: whether a request that may speculate stops the engine from planning a
        step ahead (async scheduling on)."""
        self.config = config
        self.proposer = proposer or make_proposer(config)
        self.step_cost = step_cost
        self.gives_up_async = gives_up_async
        # Whether a look-up can be replayed on the host for free (a shadow look-up, above).
        self._scores_on_host = isinstance(self.proposer, NgramProposer)
        # Whether the proposer drafts for a whole step at once (a draft model's batched forward);
        # n-gram look-ups do not, and `prepare` is then never needed.
        self._propose_many = getattr(self.proposer, "propose_many", None)
        self._tracks: dict[str, _Track] = {}  # req_id -> its recent look-ups
        self._num_decodes = 1  # the running requests of the step being planned (step_allows)
        # Cumulative, as vLLM counts them: verify rows that carried drafts, drafted tokens,
        # accepted drafts (by position in the run), tokens emitted by those rows (accepted + 1,
        # less any cut by a stop or max_tokens).
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_emitted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * config.num_speculative_tokens
        self.num_lookups = 0  # decodes that looked for drafts (found or not): each held a step back
        self.num_backoffs = 0  # requests turned off by the rule
        self.num_resumes = 0  # requests turned back on (shadow look-ups passed, or a back-off ran out)
        # Drafts proposed ahead for this step (prepare): req_id -> (its num_tokens then, drafts).
        self._prepared: dict[str, tuple[int, list[int]]] = {}
        # n-gram: the look-up `_may_find` made (req_id -> (num_tokens then, drafts)), and its
        # answer (req_id -> (num_tokens, num_pending_tokens, may find)) until the request moves on.
        self._looked_up: dict[str, tuple[int, list[int]]] = {}
        self._known: dict[str, tuple[int, int, bool]] = {}

    def wants_to_speculate(self, request: Request) -> bool:
        """Eligible, not backed off, and its next look-up may find drafts: it proposes at its next
        decode with its token on the host (and until then holds async scheduling back)."""
        if not can_speculate(request):
            return False
        track = self._tracks.get(request.req_id)
        if track is not None and not track.is_on:
            if self._scores_on_host:
                self._shadow_lookups(request, track)
            elif request.num_output_tokens >= track.resume_at:
                self._turn_on(track)
            if not track.is_on:
                return False
        return self._may_find(request)

    def _may_find(self, request: Request) -> bool:
        """Whether the request's next look-up can find drafts, where the host can tell (n-gram,
        suffixes of two tokens or more): with all its tokens on the host, the look-up itself (kept
        for `propose`; one that finds nothing counts as a look-up, as the engine held a step back
        for it); with its next input token still pending on the device, whether its last known
        token occurred before (a suffix ending with the pending token needs that pair before).
        A request whose look-up cannot find anything holds no step back: it is scheduled ahead
        like any other, and its look-ups resume once its last token occurred before."""
        if not self._scores_on_host or self.proposer.min_n < 2:
            return True
        known = self._known.get(request.req_id)
        if known is not None and known[0] == request.num_tokens and known[1] == request.num_pending_tokens:
            return known[2]
        if request.num_pending_tokens == 1:
            tokens = request.all_token_ids
            may_find = tokens[-1] in tokens[:-1]
        elif (not request.num_pending_tokens and not request.num_in_flight_tokens
              and request.num_computed_tokens == request.num_tokens - 1):  # a decode, token on the host
            drafts = self.proposer.propose(request.all_token_ids, self.config.num_speculative_tokens)
            self._looked_up[request.req_id] = (request.num_tokens, drafts)
            may_find = bool(drafts)
            if not may_find:
                self.num_lookups += 1
                self._note(request, 0, 0)
        else:
            return True  # a prefill: its look-ups come later
        self._known[request.req_id] = (request.num_tokens, request.num_pending_tokens, may_find)
        return may_find

    def step_allows(self, num_running: int) -> bool:
        """Whether a step of `num_running` requests may carry drafts; the rule then prices each
        request's look-ups in a step of that many decodes."""
        self._num_decodes = num_running
        return num_running <= self.config.disable_by_batch_size

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """Drafts for the request's next decode (at most max_drafts and K); [] when it does not
        speculate now."""
        max_drafts = min(max_drafts, self.config.num_speculative_tokens)
        if max_drafts <= 0 or not self.wants_to_speculate(request):
            return []
        self.num_lookups += 1
        prepared = self._prepared.pop(request.req_id, None) or self._looked_up.pop(request.req_id, None)
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
        if not track.is_on or len(track.recent) < _MIN_JUDGED:
            return
        if len(track.recent) == _WINDOW and self._pays(track.recent):
            track.num_backoffs = 0  # (a draft model's next back-off starts short again)
            return
        # A window not full yet is judged as if its other look-ups were all its best one: where
        # even that would not pay, waiting for them would only cost more steps without a step ahead.
        best = max(track.recent, key=lambda lookup: lookup[1])
        if self._pays([*track.recent, *[best] * (_WINDOW - len(track.recent))]):
            return
        track.is_on = False
        self.num_backoffs += 1
        track.num_backoffs += 1
        # (noted before the look-up's tokens are appended: the next look-up comes after them)
        track.shadow_at = request.num_tokens + num_accepted + 1
        doublings = min(track.num_backoffs - 1, _MAX_BACKOFF_DOUBLINGS)
        track.resume_at = (request.num_output_tokens + num_accepted + 1
                           + self.config.backoff_steps * 2 ** doublings)

    def _pays(self, lookups) -> bool:
        """The rule: the look-ups' drafts accepted at min_acceptance_rate or more, and their
        predicted speedup (gain.py) at min_speedup or more."""
        lookups = list(lookups)
        # A look-up that found nothing counts as K drafted, none accepted.
        drafted = sum(d if d else self.config.num_speculative_tokens for d, _ in lookups)
        accepted = sum(a for _, a in lookups)
        if accepted < self.config.min_acceptance_rate * drafted:
            return False
        return self.predicted_speedup(lookups) >= self.config.min_speedup

    def predicted_speedup(self, lookups) -> float:
        """What look-ups of (drafted, accepted) each would speed the planned step up by (gain.py)."""
        return predicted_speedup(lookups, self._num_decodes, self._step_ms(), self.gives_up_async)

    def _step_ms(self) -> StepMs | None:
        """The cost model's predictions, once it has two points: from one it would scale a
        step's time with its tokens, and price every verify row as a whole step."""
        cost = self.step_cost() if self.step_cost is not None else None
        points = cost.points() if cost is not None else []
        if len(points) < 2:
            return None
        # Each row, a verify's draft rows included, reads about its request's context: priced at
        # what a row read in the steps nearest this one's size (without it the curve is the
        # steps' time at no context, and a plain step looks cheaper than it is).
        near = min(points, key=lambda point: abs(point.num_tokens - self._num_decodes))
        per_row = near.kv / near.num_tokens if near.num_tokens > 0 else 0.0
        return lambda num_tokens: cost.predict(num_tokens, round(num_tokens * per_row))

    def _shadow_lookups(self, request: Request, track: _Track) -> None:
        """Replay, on the host, the look-ups a backed-off n-gram request would have made since,
        each scored against the tokens produced after it; back on when the window passes."""
        k = self.config.num_speculative_tokens
        if track.shadow_at + k > request.num_tokens:
            return  # (checked first: the tokens' list is a copy)
        tokens = request.all_token_ids
        while track.shadow_at + k <= len(tokens):
            at = track.shadow_at
            drafts = self.proposer.propose(tokens[:at], k, req_id=request.req_id)
            accepted = next((i for i, d in enumerate(drafts) if d != tokens[at + i]), len(drafts))
            track.recent.append((len(drafts), accepted))
            track.shadow_at = at + accepted + 1  # where that verify would have left it
            if len(track.recent) >= _MIN_JUDGED and self._pays(track.recent):
                self._turn_on(track)
                return

    def _turn_on(self, track: _Track) -> None:
        track.is_on = True
        self.num_resumes += 1
        if not self._scores_on_host:  # a probe: a window of real look-ups before it is judged
            track.recent.clear()

    def forget(self, req_id: str) -> None:
        self._tracks.pop(req_id, None)
        self._looked_up.pop(req_id, None)
        self._known.pop(req_id, None)
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
