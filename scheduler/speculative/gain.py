"""Whether speculating pays: the expected gain of a request's recent look-ups, priced by the step
cost model.

A look-up that proposed d drafts of which a were accepted (d = a = 0: it found nothing) made
1 + a tokens for its request in a step of B + d tokens, B being the step's plain decodes (one
token each). Decoding plainly, the request makes one token in a step of B tokens. Over the
request's recent look-ups i, with T(n) the predicted time of an n-token step, the step's tokens
per millisecond with and without this request's speculation compare as

    speedup = [sum_i (B + a_i) / sum_i (T(B + d_i) + h)] / [B / T(B)]

where h is the host's work between two steps that speculation exposes: a request that may
speculate needs its last token on the host before its next step is planned, so the engine gives
up async scheduling (planning step n+1 while the device runs step n) while it runs, and the
scheduler's work between steps (taking the step's tokens in, planning the next) adds to every
step. The cost model does not see it: it times a step from its submission (or the previous
result) to its result. With async scheduling off, every step waits for the host anyway: h is 0.

The rule needs no acceptance threshold of its own: a look-up that found nothing costs h and
gains nothing; one accepting everything gains K tokens for the price of K extra rows.

The numbers come from one H100 run (bfloat16, SmolLM2-135M-Instruct, batch 1, K = 4; docs/
speculative-decoding.md): a plain decode step 0.96 ms under async scheduling; with speculation
the step trace timed a step without drafts at 1.21 ms and a verify step of five rows at 1.89 ms,
and the copy's 1,905 tok/s at 4.61 tokens per verify means 2.42 ms per verify step: 0.53 ms of
host work outside the traced step (HOST_MS). Where the cost model has not timed steps of two
sizes yet, steps are priced in those proportions, in units of the plain step: a speculating step
of d drafts 1.26 + 0.18 d, plus h = 0.55. They reproduce that run: 4.61 tokens per verify give
1.83x (measured 1.88x), the chat's 2.43 give 0.96x before its look-ups that found nothing
(measured 0.89x with them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

StepMs = Callable[[int], "float | None"]  # tokens of a step -> its predicted milliseconds; None: unknown

HOST_MS = 0.5  # the host's work between two steps, outside the cost model's step times (0.53 measured)
# Where no step was timed: in plain decode steps (0.96 ms), a step that speculates without drafts
# (1.21 / 0.96), what each draft row adds to it ((1.89 - 1.21) / 4 / 0.96), and h (0.53 / 0.96).
SYNC_STEP = 1.26
ROW_COST = 0.18
HOST_SHARE = 0.55


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

        def cost(num_drafts: int) -> float:
            return (SYNC_STEP if gives_up_async else 1.0) + ROW_COST * num_drafts
    else:
        host_ms = HOST_MS

        def cost(num_drafts: int) -> float:  # (never below the plain step: more rows cost more)
            return max(step_ms(b + num_drafts) or plain_ms, plain_ms)
    host_ms = host_ms if gives_up_async else 0.0
    tokens = sum(b + accepted for _, accepted in lookups)
    ms = sum(cost(drafted) + host_ms for drafted, _ in lookups)
    return (tokens / ms) / (b / plain_ms)
