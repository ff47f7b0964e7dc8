"""What a step costs: milliseconds by the step's token count, learned from the steps the engine
timed (its warm-up's calibration, then every step it serves).

A step's time is not proportional to its tokens: a decode step reads every weight once, and
until the matrix products turn compute-bound (a few hundred tokens for an 8B model on an
H200) more tokens cost little more. So the model keeps one point per power-of-two bucket of
token counts, each an exponentially weighted mean of the (tokens, ms) of the steps that fell
in it, and predicts between the points by straight lines, made non-decreasing (a step never
costs less for more tokens). Past the largest point it extends the last segment; with one point
only, it scales that point's time with the tokens (compute-bound: pessimistic, so a budget
derived from it errs short).

The engine feeds it (`observe`) with the time between one step's result and the previous one's
(or the step's submission, when the device was idle): under async scheduling that is what a
token of the step waits for, host work included.
"""

from __future__ import annotations

from dataclasses import dataclass

EWMA_WEIGHT = 0.1  # of a new step in its bucket's mean: ~10 steps to follow a change
# Once a bucket has seen this many steps, a step counts as at most OUTLIER_FACTOR times its mean.
SETTLED_STEPS = 5
OUTLIER_FACTOR = 3.0


@dataclass
class CostPoint:
    num_tokens: float  # mean token count of the steps in the bucket
    ms: float  # their mean time
    num_steps: int  # steps observed in the bucket


class StepCost:
    def __init__(self) -> None:
        self._buckets: dict[int, CostPoint] = {}  # bit_length of the token count -> its point
        self._curve: list[tuple[float, float]] | None = None  # (tokens, ms), sorted, non-decreasing

    def observe(self, num_tokens: int, ms: float) -> None:
        if num_tokens < 1 or not ms > 0:
            return
        key = num_tokens.bit_length()
        point = self._buckets.get(key)
        if point is None:
            self._buckets[key] = CostPoint(float(num_tokens), float(ms), 1)
        else:
            if point.num_steps >= SETTLED_STEPS:
                ms = min(ms, OUTLIER_FACTOR * point.ms)  # a pause (GC, a page fault) is not the step's
            point.num_tokens += EWMA_WEIGHT * (num_tokens - point.num_tokens)
            point.ms += EWMA_WEIGHT * (ms - point.ms)
            point.num_steps += 1
        self._curve = None

    def reset(self) -> None:
        """Forget every step (the warm-up's first pass, which compiles, is no measure)."""
        self._buckets.clear()
        self._curve = None

    @property
    def is_known(self) -> bool:
        return bool(self._buckets)

    def points(self) -> list[CostPoint]:
        """The learned points, fewest tokens first (for logs and benchmarks)."""
        return [self._buckets[key] for key in sorted(self._buckets)]

    def _points(self) -> list[tuple[float, float]]:
        if self._curve is None:
            curve, highest = [], 0.0
            for point in self.points():
                highest = max(highest, point.ms)
                curve.append((point.num_tokens, highest))
            self._curve = curve
        return self._curve

    def predict(self, num_tokens: int) -> float | None:
        """Milliseconds of a step of `num_tokens` tokens; None before any step was observed."""
        curve = self._points()
        if not curve:
            return None
        first_tokens, first_ms = curve[0]
        if num_tokens <= first_tokens:
            return first_ms
        if len(curve) == 1:
            return first_ms * num_tokens / first_tokens
        for (x0, y0), (x1, y1) in zip(curve, curve[1:], strict=False):
            if num_tokens <= x1:
                return y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = curve[-2], curve[-1]
        return y1 + (y1 - y0) * (num_tokens - x1) / (x1 - x0)

    def max_tokens_within(self, ms: float, limit: int) -> int | None:
        """The most tokens (at most `limit`) a step may have and be predicted within `ms`; 0 when
        not even one token is; None before any step was observed."""
        if not self._buckets:
            return None
        if self.predict(1) > ms:
            return 0
        low, high = 1, limit  # predict(low) <= ms holds; the answer is in [low, high]
        while low < high:
            middle = (low + high + 1) // 2
            if self.predict(middle) <= ms:
                low = middle
            else:
                high = middle - 1
        return low

    def fewest_tokens_at_rate(self, fraction: float, limit: int) -> int | None:
        """The fewest tokens (at least 1) a step may have and still run at `fraction` of the tokens
        per ms of a `limit`-token step; None before any step was observed."""
        limit_ms = self.predict(limit)
        if limit_ms is None:
            return None
        target_rate = fraction * limit / limit_ms
        low, high = 1, limit  # the rate at `high` reaches the target; the answer is in [low, high]
        while low < high:
            middle = (low + high) // 2
            if middle / self.predict(middle) >= target_rate:
                high = middle
            else:
                low = middle + 1
        return low
