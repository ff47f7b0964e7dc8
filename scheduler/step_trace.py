"""A line per engine step, for finding where a latency tail comes from (a debugging aid).

Set `TOKENFLEET_STEP_TRACE` to a file path and each engine in the process appends one JSON line
per step it takes back: when its result came back (wall clock, as the request records'
timestamps are, so a slow request can be laid beside the steps it waited through), how long the
step took, its tokens, the most important work's share of them, the budget's cap, how many rows
it had and how many of them were prefill chunks, how many requests ran and waited, and how many
it preempted. It also says what the step was made of, for the step budget's account
(scheduler/step_budget.py): the interactive rows and tokens, the batch items' decode rows and
prefill tokens, the context tokens its rows read (`kv_tokens`), and the milliseconds the step cost
model predicted for it when it was planned, beside the `ms` the engine measured; and its grammar
work: its constrained rows, whether it sampled late, the host's time filling its mask, and for a
late step the time from its submission to its sampling.
Off (no file), it costs one attribute test per step.
"""

from __future__ import annotations

import json
import os
import time
from typing import TextIO

from scheduler.request import BATCH_PRIORITY

ENV_VAR = "TOKENFLEET_STEP_TRACE"


def open_from_env() -> TextIO | None:
    """The trace file named by the environment, opened to append (line-buffered); else None."""
    path = os.environ.get(ENV_VAR)
    return open(path, "a", buffering=1) if path else None  # noqa: SIM115 - lives with the engine


def step_parts(output) -> dict[str, int]:
    """What a step (its SchedulerOutput) was made of: interactive rows and tokens, batch decode
    rows and prefill tokens (a row of one token, drafts aside, is a decode), context tokens read."""
    parts = {"chat_rows": 0, "chat_tokens": 0, "batch_decode_rows": 0, "batch_prefill_tokens": 0,
             "batch_decode_tokens": 0, "kv_tokens": 0}
    for (request, _), work in zip(output.scheduled_requests, output.batch.works, strict=True):
        num_tokens = len(work.token_ids)
        parts["kv_tokens"] += work.start_pos + num_tokens
        if request.priority < BATCH_PRIORITY:
            parts["chat_rows"] += 1
            parts["chat_tokens"] += num_tokens
        elif num_tokens - work.num_draft_tokens <= 1:
            parts["batch_decode_rows"] += 1
            parts["batch_decode_tokens"] += num_tokens
        else:
            parts["batch_prefill_tokens"] += num_tokens
    return parts


def write_step(trace: TextIO, output, ms: float, scheduler) -> None:
    """One step's line (output: the step's SchedulerOutput)."""
    works = output.batch.works
    budget = scheduler.latency_budget
    predicted = output.predicted_ms
    trace.write(json.dumps({
        "t": round(time.time(), 4), "step": output.batch.step_id, "ms": round(ms, 2),
        "predicted_ms": None if predicted is None else round(predicted, 2),
        "tokens": output.batch.num_tokens, "top_tokens": output.num_top_tokens,
        "cap": output.step_token_cap, "rows": len(works),
        "prefill_rows": sum(len(w.token_ids) > 1 for w in works),
        **step_parts(output),
        "running": scheduler.num_running_requests, "waiting": scheduler.num_waiting_requests,
        "preempted": len(output.preempted_req_ids),
        "guard": round(budget.guard, 3),  # the auto budget's correction (step_budget.py)
        "us_per_kv_token": round(budget.cost.ms_per_kv_token * 1e3, 5),  # the cost model's (step_cost.py)
        **grammar_parts(output, scheduler.grammars),
    }) + "\n")


def grammar_parts(output, grammars) -> dict:
    """A step's grammar work: its constrained rows that sampled, whether it sampled late (after
    the step before it was taken back), the host's milliseconds filling its mask, and for a late
    step the milliseconds from its submission to its sampling."""
    batch = output.batch
    rows = 0 if grammars is None or not len(grammars) else sum(
        w.is_sampled and w.req_id in grammars for w in batch.works)
    return {"constrained_rows": rows, "samples_late": batch.samples_late,
            "fill_ms": round(batch.mask_fill_s * 1e3, 3),
            "late_wait_ms": round(batch.late_sample_wait_s * 1e3, 3) if batch.samples_late else None}
