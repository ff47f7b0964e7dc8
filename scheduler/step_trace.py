"""A line per engine step, for finding where a latency tail comes from (a debugging aid).

Set `TOKENFLEET_STEP_TRACE` to a file path and each engine in the process appends one JSON line
per step it takes back: when its result came back (wall clock, as the request records'
timestamps are, so a slow request can be laid beside the steps it waited through), how long the
step took, its tokens, the most important work's share of them, the budget's cap, how many rows
it had and how many of them were prefill chunks, how many requests ran and waited, and how many
it preempted. Off (no file), it costs one attribute test per step.
"""

from __future__ import annotations

import json
import os
import time
from typing import TextIO

ENV_VAR = "TOKENFLEET_STEP_TRACE"


def open_from_env() -> TextIO | None:
    """The trace file named by the environment, opened to append (line-buffered); else None."""
    path = os.environ.get(ENV_VAR)
    return open(path, "a", buffering=1) if path else None  # noqa: SIM115 - lives with the engine


def write_step(trace: TextIO, output, ms: float, scheduler) -> None:
    """One step's line (output: the step's SchedulerOutput)."""
    works = output.batch.works
    trace.write(json.dumps({
        "t": round(time.time(), 4), "step": output.batch.step_id, "ms": round(ms, 2),
        "tokens": output.batch.num_tokens, "top_tokens": output.num_top_tokens,
        "cap": output.step_token_cap, "rows": len(works),
        "prefill_rows": sum(len(w.token_ids) > 1 for w in works),
        "running": scheduler.num_running_requests, "waiting": scheduler.num_waiting_requests,
        "preempted": len(output.preempted_req_ids),
        "allowance": scheduler.latency_budget.allowance,
    }) + "\n")
