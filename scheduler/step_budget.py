"""How many tokens a step may carry while more important work runs or waits (stall-free batching,
after Sarathi-Serve): the latency budget of a step that lower-priority prefill must fit in.

A step's decodes always run, and so do the prefill chunks of the most important requests present
(an interactive prompt's TTFT does not wait on a cap). Prefill of every less important request
(batch items, and interactive requests of a lower priority) only fills the step up to the budget:
the most tokens whose step the cost model (scheduler/step_cost.py) predicts within

- `itl_target_ms`, when set: an absolute bound on the step;
- else `slowdown` times the predicted time of a step of the most important work alone (its
  decodes and prefill): beside batch work a chat's step takes at most that much longer than it
  would alone. Less important decodes count against the budget, not towards its base: while
  they fill it, less important prefill waits, and fewer batch items run.

With nothing more important present there is no budget: the whole `max_num_batched_tokens`.
Until the engine has timed a step, the budget is `FALLBACK_STEP_TOKENS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.step_cost import StepCost
from shared.config import DEFAULT_ITL_SLOWDOWN as DEFAULT_SLOWDOWN

FALLBACK_STEP_TOKENS = 512  # before any step was timed: a step about as long as a few decodes


@dataclass
class LatencyBudget:
    # Milliseconds a step may take beside more important work; None: `slowdown` times the step of
    # the most important work alone; 0: no budget (less important work shares steps freely).
    itl_target_ms: float | None = None
    slowdown: float = DEFAULT_SLOWDOWN
    cost: StepCost = field(default_factory=StepCost)

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
            base_ms = self.cost.predict(max(1, num_protected_tokens))
            if base_ms is None:
                return min(limit, max(FALLBACK_STEP_TOKENS, num_protected_tokens))
            target_ms = self.slowdown * base_ms
        within = self.cost.max_tokens_within(target_ms, limit)
        return min(limit, FALLBACK_STEP_TOKENS) if within is None else within
