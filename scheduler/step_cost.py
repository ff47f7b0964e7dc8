"""What a step costs: milliseconds by the step's token count and the context its rows read,
learned from the steps the engine timed (its warm-up's calibration, then every step it serves).

A step's time is not proportional to its tokens: a decode step reads every weight once, and
until the matrix products turn compute-bound (a few hundred tokens for an 8B model on an
H200) more tokens cost little more. So the model keeps one point per power-of-two bucket of
token counts, each an exponentially weighted mean of the (tokens, ms) of the steps that fell
in it, and predicts between the points by straight lines, made non-decreasing (a step never
costs less for more tokens). Past the largest point it extends the last segment; with one point
only, it scales that point's time with the tokens (compute-bound: pessimistic, so a budget
derived from it errs short).

Tokens alone do not say what a step costs, though: each row reads its whole context's K/V
cache, so 500 decode rows of 700 tokens each cost an 8B model on an H100 more than its weights
do, while 500 prefill tokens of one prompt cost little more than a decode. So a step also
carries its context tokens (`kv_tokens`: over its rows, the positions each one attends to), and
the model learns one more number, the milliseconds a context token adds (`ms_per_kv_token`):
within each bucket (steps of about the same tokens) the steps that read more context took
longer, and the slope pooled over the buckets is that cost: a least-squares fit of ms on the
context with one intercept and one token slope a bucket, from the buckets' weighted moments,
each bucket weighed by its steps over its time squared (noise grows with a step's time).
The token count is partialled out within a bucket because a prefill's context grows with its
chunk: without it, a bucket of prefill steps of 2,100 to 4,000 tokens would charge their
tokens' cost to their context, and make every decode look hundreds of times dearer than it is.
The curve of tokens is then each bucket's time at no context (its mean less the slope times its
mean context), and a step is predicted as the curve at its tokens plus the slope times its
context. Where the context never varied apart from the tokens within a bucket (every unit test's
cost model of tokens alone) the slope is 0 and the model is the curve of tokens alone.

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
# A bucket's time at no context never goes below this share of its mean time: a slope learned
# from a few noisy steps does not make a bucket's work free.
MIN_INTERCEPT_SHARE = 0.02
EFFECTIVE_STEPS = 19  # what an exponentially weighted mean of weight EWMA_WEIGHT amounts to


@dataclass
class CostPoint:
    num_tokens: float  # mean token count of the steps in the bucket
    ms: float  # their mean time
    num_steps: int  # steps observed in the bucket
    # Weighted means as for ms (each step's weight as in `observe`): of the context tokens, and
    # of the products a least-squares fit needs.
    kv: float = 0.0
    kv2: float = 0.0  # context tokens squared
    kv_ms: float = 0.0  # context tokens times ms
    t2: float = 0.0  # tokens squared
    t_kv: float = 0.0  # tokens times context tokens
    t_ms: float = 0.0  # tokens times ms

    def add(self, num_tokens: float, ms: float, kv: float, weight: float) -> None:
        """Move every mean `weight` of the way to this step's value."""
        for name, value in (("num_tokens", num_tokens), ("ms", ms), ("kv", kv), ("kv2", kv * kv),
                            ("kv_ms", kv * ms), ("t2", num_tokens * num_tokens),
                            ("t_kv", num_tokens * kv), ("t_ms", num_tokens * ms)):
            mean = getattr(self, name)
            setattr(self, name, mean + weight * (value - mean))

    def context_moments(self) -> tuple[float, float]:
        """The bucket's variance of the context, and its covariance with the ms, both with the
        token count partialled out (what the context explains that the tokens do not)."""
        var_kv = self.kv2 - self.kv * self.kv
        cov_kv_ms = self.kv_ms - self.kv * self.ms
        var_t = self.t2 - self.num_tokens * self.num_tokens
        if var_t > 1e-9 * max(1.0, self.t2):
            cov_t_kv = self.t_kv - self.num_tokens * self.kv
            cov_t_ms = self.t_ms - self.num_tokens * self.ms
            var_kv -= cov_t_kv * cov_t_kv / var_t
            cov_kv_ms -= cov_t_kv * cov_t_ms / var_t
        # (Rounding leaves a context that only followed the tokens a sliver of variance: none.)
        if var_kv <= 1e-9 * max(1.0, self.kv2):
            return 0.0, 0.0
        return var_kv, cov_kv_ms


class StepCost:
    def __init__(self) -> None:
        self._buckets: dict[int, CostPoint] = {}  # bit_length of the token count -> its point
        self._curve: list[tuple[float, float]] | None = None  # (tokens, ms at no context), sorted
        self._slope: float | None = None  # ms a context token adds (cached with the curve)

    def observe(self, num_tokens: int, ms: float, kv_tokens: int = 0) -> None:
        """A step of `num_tokens` tokens whose rows read `kv_tokens` context tokens took `ms`."""
        if num_tokens < 1 or not ms > 0:
            return
        key = num_tokens.bit_length()
        point = self._buckets.get(key)
        kv = float(max(0, kv_tokens))
        if point is None:
            point = self._buckets[key] = CostPoint(0.0, 0.0, 0)
            point.add(float(num_tokens), float(ms), kv, 1.0)
        else:
            if point.num_steps >= SETTLED_STEPS:
                ms = min(ms, OUTLIER_FACTOR * point.ms)  # a pause (GC, a page fault) is not the step's
            point.add(float(num_tokens), float(ms), kv, EWMA_WEIGHT)
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

    @property
    def ms_per_kv_token(self) -> float:
        """The milliseconds a context token adds to a step (0 until the steps show it)."""
        self._points()
        return self._slope or 0.0

    def _points(self) -> list[tuple[float, float]]:
        if self._curve is None:
            points = self.points()
            # A settled bucket (a few steps cannot tell the context's cost from a noisy host's)
            # weighs by its steps (up to the ~19 an exponentially weighted mean of weight 0.1
            # amounts to) over its time squared: a step's noise grows with its time (a loaded
            # host, a GC pause), and one slow bucket would otherwise set the slope for all.
            var = cov = 0.0
            for point in points:
                if point.num_steps >= SETTLED_STEPS:
                    point_var, point_cov = point.context_moments()
                    weight = min(point.num_steps - 1, EFFECTIVE_STEPS) / (point.ms * point.ms)
                    var += weight * point_var
                    cov += weight * point_cov
            # Context that varies by less than a token within the buckets says nothing of its cost.
            slope = max(0.0, cov / var) if var > 0.0 else 0.0
            curve, highest = [], 0.0
            for point in points:
                at_no_context = max(MIN_INTERCEPT_SHARE * point.ms, point.ms - slope * point.kv)
                highest = max(highest, at_no_context)
                curve.append((point.num_tokens, highest))
            self._curve, self._slope = curve, slope
        return self._curve

    def predict(self, num_tokens: int, kv_tokens: int = 0) -> float | None:
        """Milliseconds of a step of `num_tokens` tokens whose rows read `kv_tokens` context
        tokens; None before any step was observed."""
        curve = self._points()
        if not curve:
            return None
        context_ms = (self._slope or 0.0) * kv_tokens
        first_tokens, first_ms = curve[0]
        if num_tokens <= first_tokens:
            return first_ms + context_ms
        if len(curve) == 1:
            return first_ms * num_tokens / first_tokens + context_ms
        for (x0, y0), (x1, y1) in zip(curve, curve[1:], strict=False):
            if num_tokens <= x1:
                return y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0) + context_ms
        (x0, y0), (x1, y1) = curve[-2], curve[-1]
        return y1 + (y1 - y0) * (num_tokens - x1) / (x1 - x0) + context_ms

    def max_tokens_within(self, ms: float, limit: int, kv_tokens: int = 0) -> int | None:
        """The most tokens (at most `limit`) a step whose rows read `kv_tokens` context tokens may
        have and be predicted within `ms`; 0 when not even one token is; None before any step
        was observed."""
        if not self._buckets:
            return None
        if self.predict(1, kv_tokens) > ms:
            return 0
        low, high = 1, limit  # predict(low) <= ms holds; the answer is in [low, high]
        while low < high:
            middle = (low + high + 1) // 2
            if self.predict(middle, kv_tokens) <= ms:
                low = middle
            else:
                high = middle - 1
        return low

    def max_chunk_within(self, ms: float, num_tokens: int, kv_tokens: int, start_pos: int,
                         limit: int) -> int:
        """The longest prefill chunk (at most `limit` tokens) from position `start_pos` that a
        step of `num_tokens` tokens reading `kv_tokens` context may add and stay predicted within
        `ms` (the chunk adds its tokens, and reads its prefix and itself); 0 when none fits or
        before any step was observed."""
        if limit < 1 or not self._buckets:
            return 0

        def fits(chunk: int) -> bool:
            return self.predict(num_tokens + chunk, kv_tokens + start_pos + chunk) <= ms

        if fits(limit):  # (a decode's one token: a single prediction)
            return limit
        if not fits(1):
            return 0
        low, high = 1, limit
        while low < high:
            middle = (low + high + 1) // 2
            if fits(middle):
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
