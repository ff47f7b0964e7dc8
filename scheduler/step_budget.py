"""How many tokens a step may carry while more important work runs or waits (stall-free batching,
after Sarathi-Serve): the latency budget of a step that lower-priority prefill must fit in.

A step's decodes always run, and so do the prefill chunks of the most important requests present
(an interactive prompt's TTFT does not wait on a cap). Prefill of every less important request
(batch items, and interactive requests of a lower priority) only fills the step up to the budget:
the most tokens whose step the cost model (scheduler/step_cost.py) predicts within

- `itl_target_ms`, when set: an absolute bound on the step;
- else `slowdown` times the time of a step of the most important work alone (its decodes and
  prefill): beside batch work a chat's step takes at most that much longer than it would alone.
  Less important decodes count against the budget too: past it they skip the step (keeping their
  KV cache; the ones that waited longest go first), so the batch items that run shrink to what
  the budget holds.

The auto budget is a feedback loop, because tokens alone do not say what a step costs: a batch
decode row reads its whole context's KV cache, so 500 of them at 700 tokens each cost an 8B model
on an H200 more than the weights do. The engine times every step (`observe`). Steps with only the
most important work teach a cost curve of that work alone; after a step that also carried less
important work, the allowance of less important tokens shrinks by a fifth if the step took longer
than `slowdown` times what its most important tokens alone would have, and grows by a twentieth
(plus a token) if it stayed within while the cap held work back. Until a step beside such work was
timed, the allowance starts from the cost curve's prediction.

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
Until the engine has timed a step, the budget is `FALLBACK_STEP_TOKENS`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.step_cost import StepCost
from shared.config import DEFAULT_ITL_SLOWDOWN as DEFAULT_SLOWDOWN

FALLBACK_STEP_TOKENS = 512  # before any step was timed: a step about as long as a few decodes
# The fewest tokens of less important work a step takes beside more important work: batch items
# keep moving, however long the most important work's own steps run.
MIN_ALLOWANCE_TOKENS = 32
SHRINK, GROW = 0.8, 1.05  # the allowance after a step over the budget, and after one within it
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
class LatencyBudget:
    # Milliseconds a step may take beside more important work; None: `slowdown` times the step of
    # the most important work alone; 0: no budget (less important work shares steps freely).
    itl_target_ms: float | None = None
    slowdown: float = DEFAULT_SLOWDOWN
    cost: StepCost = field(default_factory=StepCost)
    # Steps that carried only the most important work: the base the slowdown multiplies.
    alone_cost: StepCost = field(default_factory=StepCost)
    # Tokens of less important work a step may add to the most important work's (auto mode);
    # None until the first step beside such work was timed.
    allowance: float | None = None
    recent_top: RecentPriority = field(default_factory=RecentPriority)

    def __post_init__(self) -> None:
        if self.itl_target_ms is not None and self.itl_target_ms < 0:
            raise ValueError(f"itl_target_ms must be >= 0, got {self.itl_target_ms}")
        if self.slowdown < 1:
            raise ValueError(f"the slowdown must be >= 1, got {self.slowdown}")

    @property
    def is_off(self) -> bool:
        return self.itl_target_ms == 0

    def step_tokens(self, num_protected_tokens: int, limit: int) -> int:
        """The most tokens the whole step may have, given the tokens of its most important work
        (decodes and prefill); at most `limit`."""
        if self.is_off:
            return limit
        target_ms = self.itl_target_ms
        if target_ms is None:
            if self.allowance is not None:  # corrected by the steps timed beside such work
                return min(limit, num_protected_tokens + int(self.allowance))
            base_ms = self._alone_ms(max(1, num_protected_tokens))
            if base_ms is None:
                return min(limit, max(FALLBACK_STEP_TOKENS, num_protected_tokens))
            target_ms = self.slowdown * base_ms
        within = self.cost.max_tokens_within(target_ms, limit)
        if within is None:
            return min(limit, FALLBACK_STEP_TOKENS)
        if within <= num_protected_tokens:  # the most important work alone is over the target:
            within = num_protected_tokens + MIN_ALLOWANCE_TOKENS  # less important work still moves
        return min(limit, within)

    def batch_step_tokens(self, limit: int, num_decodes: int) -> int:
        """The tokens of a step of batch work alone: what the cost model predicts within
        `BATCH_STEP_MS`, but at least the fewest that run at `BATCH_STEP_EFFICIENCY` of a
        `limit`-token step's tokens per ms (where steps have a high fixed cost, as on a loaded
        CPU, a 50 ms step may hold no token at all) and at least `num_decodes` (every running
        decode still runs); at most `limit`. `limit` with the budget off or before any step was
        timed."""
        within = None if self.is_off else self.cost.max_tokens_within(BATCH_STEP_MS, limit)
        if within is None:
            return limit
        efficient = self.cost.fewest_tokens_at_rate(BATCH_STEP_EFFICIENCY, limit)
        return min(limit, max(within, efficient, num_decodes))

    def reset(self) -> None:
        """Forget every step timed (the warm-up's, whose first steps compile)."""
        self.cost.reset()
        self.alone_cost.reset()
        self.allowance = None
        self.recent_top.priority = None

    def _alone_ms(self, num_tokens: int) -> float | None:
        """A step of only the most important work: from such steps, else from every step."""
        alone = self.alone_cost.predict(num_tokens)
        return alone if alone is not None else self.cost.predict(num_tokens)

    def observe(self, num_tokens: int, num_protected_tokens: int, ms: float, *, was_capped: bool,
                limit: int) -> None:
        """A step's time (from the engine): `num_protected_tokens` of its `num_tokens` were the
        most important work's; `was_capped` when the step's cap held less important work back."""
        self.cost.observe(num_tokens, ms)
        if num_protected_tokens <= 0:
            return  # no more important work: no budget to keep
        if num_tokens == num_protected_tokens:
            self.alone_cost.observe(num_tokens, ms)
            return
        if self.itl_target_ms is not None:
            return  # an absolute target: the cost curve alone sets the cap
        base_ms = self._alone_ms(num_protected_tokens)
        if base_ms is None:
            return
        if self.allowance is None:
            self.allowance = float(max(MIN_ALLOWANCE_TOKENS, num_tokens - num_protected_tokens))
        if ms > self.slowdown * base_ms:
            self.allowance = max(float(MIN_ALLOWANCE_TOKENS), self.allowance * SHRINK)
        elif was_capped:
            self.allowance = min(float(limit), self.allowance * GROW + 1)
