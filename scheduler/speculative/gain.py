"""Whether speculating pays: the expected gain of a request's recent look-ups, priced by the step
cost model.

A look-up that proposed d drafts of which a were accepted (d = a = 0: it found nothing) made
1 + a tokens for its request in a step of B + d tokens, B being the step's plain decodes (one
token each). Decoding plainly, the request makes one token in a step of B tokens. Over the
request's recent look-ups i, with T(n) the predicted time of an n-token step, the step's tokens
per millisecond with and without this request's speculation compare as

    speedup = [sum_i (B + a_i) / sum_i (T(B + d_i) + h)] / [B / T(B)]

where h is the host's work between steps that speculation exposes: a request that may
speculate needs its last token on the host before its next step is planned, so the engine
gives up async scheduling (planning step n+1 while the device runs step n) while it runs. With
async scheduling off, every step waits for the host anyway, and h is 0.

The rule needs no acceptance threshold of its own: a look-up that found nothing costs h and
gains nothing; one accepting everything gains K tokens for the price of K extra rows.

Where the cost model knows nothing yet (no step timed), steps are priced in units of T(B) from
one H100 run (bfloat16, SmolLM2-135M-Instruct, batch 1; docs/speculative-decoding.md): a decode
step 0.96 ms under async scheduling, 1.21 ms without it (h = 0.25 ms), a verify step of five rows
1.89 ms, so each draft row adds about a quarter of a step (ROW_COST) and h is about a quarter of
a step (HOST_SHARE).

The cost model times steps from one result to the next, so steps that ran without a step ahead
include the host's work already, and adding h to them counts it twice: the rule errs towards
decoding plainly, which is never slower than plain.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

StepMs = Callable[[int], "float | None"]  # tokens of a step -> its predicted milliseconds; None: unknown

HOST_MS = 0.25  # the host's work between two steps (H100 trace: 1.21 ms sync - 0.96 ms async)
ROW_COST = 0.24  # a draft row's share of a decode step where no step was timed ((1.89 / 0.96 - 1) / 4)
HOST_SHARE = 0.26  # h in decode steps where no step was timed (0.25 / 0.96)


def predicted_speedup(lookups: Iterable[tuple[int, int]], num_decodes: int, step_ms: StepMs | None,
                      gives_up_async: bool) -> float:
    """The speedup above for look-ups of (drafted, accepted) each, in steps of `num_decodes`
    plain decodes (at least 1); 1.0 for no look-ups. `gives_up_async`: whether speculating
    costs the engine its async scheduling (the host's work, h, shows)."""
    lookups = list(lookups)
    if not lookups:
        return 1.0
    b = max(1, num_decodes)
    plain_ms = step_ms(b) if step_ms is not None else None
    if plain_ms is None or not plain_ms > 0:  # nothing timed: the H100 run's proportions
        plain_ms, host_ms = 1.0, HOST_SHARE

        def cost(num_tokens: int) -> float:
            return 1.0 + ROW_COST * (num_tokens - b)
    else:
        host_ms = HOST_MS

        def cost(num_tokens: int) -> float:  # (never below the plain step: more rows cost more)
            return max(step_ms(num_tokens) or plain_ms, plain_ms)
    host_ms = host_ms if gives_up_async else 0.0
    tokens = sum(b + accepted for _, accepted in lookups)
    ms = sum(cost(b + drafted) + host_ms for drafted, _ in lookups)
    return (tokens / ms) / (b / plain_ms)
