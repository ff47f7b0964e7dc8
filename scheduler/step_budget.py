"""How long a step may take while more important work runs or waits (stall-free batching, after
Sarathi-Serve), and which less important work fits in that time.

A step's decodes of the most important requests present always run, and so do their prefill
chunks (an interactive prompt's TTFT does not wait on a cap). Everything less important (batch
items, and interactive requests of a lower priority) only fills the step up to its budget of
time (`StepCap`):

- `itl_target_ms`, when set: an absolute bound on the step;
- else `slowdown` times the time of a step of the most important work alone (its decodes with
  their context, and prefill): beside batch work a chat's step takes at most that much longer
  than it would alone.

The budget is time, not tokens, because tokens do not say what a step costs: a batch decode row
reads its whole context's K/V cache (500 of them at 700 tokens each cost an 8B model on an H100
more than its weights do), while a prefill chunk's tokens cost about what a decode's one does
until the matrix products turn compute-bound. So the cost model (scheduler/step_cost.py)
predicts a step from its parts: its tokens and the context its rows read. The step composition
(step_composition.py) spends the time left on the cheapest batch work first: running batch
decodes (the ones left out longest first: each adds one token and its context's reads), then the
running batch prefill and new batch prompts, each chunk cut to the time left (`StepCap.chunk_within`).
Past the budget they skip the step (decodes keep their KV cache). However long the most important
work runs, a step still takes one less important row (`MIN_ALLOWANCE_TOKENS` tokens when the most
important work alone is already over the target), so batch items keep moving.

The cost model errs (it learns from steps of other shapes; the host's work varies), so in auto
mode a feedback loop guards the budget: the engine times every step (`observe`). Steps with only
the most important work teach a cost curve of that work alone; after a step that also carried less
important work, the batch's share of the budget (the time past the most important work alone:
`guard` times `slowdown - 1` times it) shrinks by a fifth if the step took longer than `slowdown`
times what its most important work alone would have, and grows by a twentieth if it stayed within
while the cap held work back (up to `MAX_GUARD`: a model that predicts too long is corrected too).

With nothing more important present there is no budget: the whole `max_num_batched_tokens`,
but only `LINGER_S` after more important work was last present (`RecentPriority`). Chats arrive
one by one: between two of them there may be a moment with none running, and a step planned then
would carry a whole budget of batch prefill (190 ms for an 8B model on an H200), which the next
chat's first token waits through. So the most important priority stays the step's reference for
a second after its last request left; past that, batch work has the whole budget again, but
in steps the cost model predicts within `BATCH_STEP_MS` (`batch_step_tokens`): with async
scheduling a chat that arrives then waits for the step in flight and the one planned behind it,
so two 190 ms steps of batch prefill put 400 ms into its first token, where two of 50 ms put
100. Big prefill steps buy little: on an H100 an 8B model's steps of ~2,000 tokens ran at about
95% of the tokens per ms of 8,192-token ones (the cost model it learned). Where they do (a high
fixed cost a step, as on a loaded CPU, where a 50 ms step may hold no token at all), a batch step
still takes the fewest tokens that run at `BATCH_STEP_EFFICIENCY` of a whole budget's rate. Every
batch decode still runs in such a step.
Until the engine has timed a step, the budget is `FALLBACK_STEP_TOKENS` tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.step_cost import StepCost
from shared.config import DEFAULT_ITL_SLOWDOWN as DEFAULT_SLOWDOWN

FALLBACK_STEP_TOKENS = 512  # before any step was timed: a step about as long as a few decodes
# The fewest tokens of less important work a step takes beside more important work whose own
# step is already over the target: batch items keep moving, however long those steps run.
MIN_ALLOWANCE_TOKENS = 32
SHRINK, GROW = 0.8, 1.05  # the guard after a step over the budget, and after one within it
# The guard's range: the batch's share of the budget never goes to nothing, and a cost model that
# predicts steps too long is corrected up to this many times its share.
MIN_GUARD, MAX_GUARD = 0.05, 4.0
LINGER_S = 1.0  # how long the most important priority seen keeps its place once none of it is present
# The longest step of batch work alone (the cost model's prediction), for the next chat's TTFT,
# unless a step that short would run at less than BATCH_STEP_EFFICIENCY of a whole budget's rate.
BATCH_STEP_MS = 50.0
BATCH_STEP_EFFICIENCY = 0.9


@dataclass
class RecentPriority:
    """The most important priority present, or seen within the last `linger_s` seconds."""

    linger_s: float = LINGER_S
    clock: Callable[[], float] = time.monotonic
    priority: int | None = None  # the most important priority seen lately
    seen_at: float = 0.0  # when it was last present (clock)

    def top(self, present: int | None) -> int | None:
        """The priority whose work a step protects, given the most important one present."""
        now = self.clock()
        if self.priority is not None and now - self.seen_at > self.linger_s:
            self.priority = None  # gone for longer than the linger: forgotten
        if present is not None and (self.priority is None or present <= self.priority):
            self.priority, self.seen_at = present, now
        return self.priority


@dataclass
class StepCap:
    """A step's budget beside more important work: the time it may take, the most tokens it may
    hold (`tokens`: what the time holds at the most important work's context), and the tokens it
    holds whatever the time (`min_tokens`: less important work keeps moving)."""

    cost: StepCost
    ms: float | None  # None: no time to keep (before any step was timed, or the budget off)
    tokens: int
    min_tokens: int

    def chunk_within(self, num_tokens: int, kv_tokens: int, start_pos: int, limit: int) -> int:
        """The most tokens (at most `limit`) a row from position `start_pos` may add to a step of
        `num_tokens` tokens reading `kv_tokens` context and stay within the time (a decode: 1 or
        0; a prefill: the chunk the time left holds)."""
        floor = max(0, min(limit, self.min_tokens - num_tokens))
        if self.ms is None or floor >= limit:
            return limit
        return max(floor, self.cost.max_chunk_within(self.ms, num_tokens, kv_tokens, start_pos, limit))


@dataclass
class LatencyBudget:
    # Milliseconds a step may take beside more important work; None: `slowdown` times the step of
    # the most important work alone; 0: no budget (less important work shares steps freely).
    itl_target_ms: float | None = None
    slowdown: float = DEFAULT_SLOWDOWN
    cost: StepCost = field(default_factory=StepCost)
    # Steps that carried only the most important work: the base the slowdown multiplies.
    alone_cost: StepCost = field(default_factory=StepCost)
    # The batch's share of the auto budget, as corrected by the steps timed beside such work.
    guard: float = 1.0
    recent_top: RecentPriority = field(default_factory=RecentPriority)

    def __post_init__(self) -> None:
        if self.itl_target_ms is not None and self.itl_target_ms < 0:
            raise ValueError(f"itl_target_ms must be >= 0, got {self.itl_target_ms}")
        if self.slowdown < 1:
            raise ValueError(f"the slowdown must be >= 1, got {self.slowdown}")

    @property
    def is_off(self) -> bool:
        return self.itl_target_ms == 0

    def target_ms(self, num_top_tokens: int, top_kv_tokens: int = 0) -> float | None:
        """How long a step beside the most important work's (its tokens and the context its rows
        read) may take; None before any step was timed (auto) or with the budget off."""
        if self.is_off:
            return None
        if self.itl_target_ms is not None:
            return self.itl_target_ms
        base_ms = self._alone_ms(max(1, num_top_tokens), top_kv_tokens)
        if base_ms is None:
            return None
        return base_ms * (1 + self.guard * (self.slowdown - 1))

    def cap(self, num_top_tokens: int, top_kv_tokens: int, limit: int) -> StepCap:
        """The budget of a step whose most important work is `num_top_tokens` tokens reading
        `top_kv_tokens` context; at most `limit` tokens."""
        target_ms = self.target_ms(num_top_tokens, top_kv_tokens)
        within = None if target_ms is None else self.cost.max_tokens_within(target_ms, limit, top_kv_tokens)
        if within is None:  # the budget off, or no step timed yet: tokens only
            if self.is_off:
                tokens = limit
            elif target_ms is None:  # auto: the most important work whole, at least
                tokens = min(limit, max(FALLBACK_STEP_TOKENS, num_top_tokens))
            else:
                tokens = min(limit, FALLBACK_STEP_TOKENS)
            return StepCap(self.cost, None, tokens, tokens)
        if within <= num_top_tokens:  # the most important work alone is over the target:
            tokens = min(limit, num_top_tokens + MIN_ALLOWANCE_TOKENS)  # less important work still moves
            return StepCap(self.cost, None, tokens, tokens)
        return StepCap(self.cost, target_ms, min(limit, within), num_top_tokens + 1)

    def step_tokens(self, num_protected_tokens: int, limit: int, top_kv_tokens: int = 0) -> int:
        """The most tokens the whole step may have, given the tokens of its most important work
        (decodes and prefill); at most `limit`."""
        return self.cap(num_protected_tokens, top_kv_tokens, limit).tokens

    def batch_step_tokens(self, limit: int, num_decodes: int, kv_tokens: int = 0) -> int:
        """The tokens of a step of batch work alone: what the cost model predicts within
        `BATCH_STEP_MS`, but at least the fewest that run at `BATCH_STEP_EFFICIENCY` of a
        `limit`-token step's tokens per ms (where steps have a high fixed cost, as on a loaded
        CPU, a 50 ms step may hold no token at all) and at least `num_decodes` (every running
        decode still runs); at most `limit`. `kv_tokens`: the context the running requests' rows
        read. `limit` with the budget off or before any step was timed."""
        within = None if self.is_off else self.cost.max_tokens_within(BATCH_STEP_MS, limit, kv_tokens)
        if within is None:
            return limit
        efficient = self.cost.fewest_tokens_at_rate(BATCH_STEP_EFFICIENCY, limit)
        return min(limit, max(within, efficient, num_decodes))

    def reset(self) -> None:
        """Forget every step timed (the warm-up's, whose first steps compile)."""
        self.cost.reset()
        self.alone_cost.reset()
        self.guard = 1.0
        self.recent_top.priority = None

    def _alone_ms(self, num_tokens: int, kv_tokens: int = 0) -> float | None:
        """A step of only the most important work: from such steps, else from every step."""
        alone = self.alone_cost.predict(num_tokens, kv_tokens)
        return alone if alone is not None else self.cost.predict(num_tokens, kv_tokens)

    def observe(self, num_tokens: int, num_protected_tokens: int, ms: float, *, was_capped: bool,
                limit: int, kv_tokens: int = 0, top_kv_tokens: int = 0) -> None:
        """A step's time (from the engine): `num_protected_tokens` of its `num_tokens` were the
        most important work's, its rows read `kv_tokens` context (`top_kv_tokens` of it the most
        important work's); `was_capped` when the step's cap held less important work back."""
        self.cost.observe(num_tokens, ms, kv_tokens)
        if num_protected_tokens <= 0:
            return  # no more important work: no budget to keep
        if num_tokens == num_protected_tokens:
            self.alone_cost.observe(num_tokens, ms, kv_tokens)
            return
        if self.itl_target_ms is not None:
            return  # an absolute target: the cost model alone sets the cap
        base_ms = self._alone_ms(num_protected_tokens, top_kv_tokens)
        if base_ms is None:
            return
        if ms > self.slowdown * base_ms:
            self.guard = max(MIN_GUARD, self.guard * SHRINK)
        elif was_capped:
            self.guard = min(MAX_GUARD, self.guard * GROW)
