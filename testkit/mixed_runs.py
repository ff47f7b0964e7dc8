"""bench_mixed_gpu.py's runs, each on its own `tokenfleet up`: on the first fleet the chats alone,
then a batch job, metered alone at its steady state (right after its ramp, over as long as the
chats alone took), then the same chats beside it (a second job cancelled mid-run), the job run to
its end; on a fleet for each further --itl-slowdown value, the job and the chats beside it again
(the job cancelled after). Every job's output lines are checked; each engine writes its step trace
(scheduler/step_trace.py) for the windows' step counts and the mixed steps' parts
(testkit/mixed_traffic.py and testkit/step_windows.py hold the parts)."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from scheduler.step_trace import ENV_VAR as STEP_TRACE_ENV
from shared.net import free_port
from testkit import mixed_traffic as mixed
from testkit.processes import Children, wait_ready
from testkit.runs import log, percentile
from testkit.serve_runs import MODEL_NAME, TTFT_PARTS, bench_args, redis_url_of, ttft_parts
from testkit.step_windows import StepWindow, in_window, read_trace
from tokenfleet import bench as fleet_bench


@dataclass
class MixedRun:
    """The chats beside the batch job on a fleet with one --itl-slowdown (None: up's default)."""

    slowdown: float | None
    beside: mixed.ChatLatency
    window: StepWindow  # while the chats ran beside the batch job
    checks: list[mixed.JobCheck] = field(default_factory=list)
    costs: list[list[list[float]]] = field(default_factory=list)  # mixed_traffic.step_costs


@dataclass
class MixedBench:
    alone: mixed.ChatLatency  # the chats alone
    batch_alone: StepWindow  # the batch job alone, at its steady state
    runs: list[MixedRun]
    num_lines: int  # of each batch job


@dataclass
class Fleet:
    url: str
    redis_url: str
    client: redis.Redis
    trace: Path  # its engines' step trace
    meter: mixed.TokenMeter


def chat_args(args: argparse.Namespace, url: str, rate: float) -> argparse.Namespace:
    """`tokenfleet bench`'s flags (bench_serve_gpu.py's chats), with --chat-max-tokens."""
    chats = bench_args(args, url, rate)
    chats.max_tokens = args.chat_max_tokens
    return chats


@dataclass
class Span:
    """When something ran: perf_counter (the meter's and the chats' clock) and wall clock (the
    step trace's)."""

    start: float
    end: float
    wall_offset: float  # time.time() - time.perf_counter()

    @classmethod
    def since(cls, start: float) -> Span:
        return cls(start, time.perf_counter(), time.time() - time.perf_counter())

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def window(self, label: str, fleet: Fleet) -> StepWindow:
        """The fleet's generated tokens in this span, from its first to its last heartbeat inside
        (the schedulers' generation counter), and the steps that came back between those two."""
        tokens, start, end = fleet.meter.tokens(self.start, self.end)
        steps = in_window(read_trace(fleet.trace), start + self.wall_offset, end + self.wall_offset)
        return StepWindow(label, end - start, tokens, steps, fleet.meter.halves(start, end))


def run_chats(args: argparse.Namespace, url: str) -> tuple[list, Span]:
    """The planned chats; their results, and when they ran."""
    started = time.perf_counter()
    results, _, _ = asyncio.run(fleet_bench.run(chat_args(args, url, args.rate)))
    return results, Span.since(started)


def log_ttft_parts(label: str, redis_url: str, results: list, dump: Path | None) -> None:
    """The chats' TTFT cut at their records' timestamps (gateway, queue, engine, delivery): where
    a tail comes from (with --logs, each chat's timestamps too, beside the step trace)."""
    parts = ttft_parts(redis_url, results, dump)
    log(f"TTFT parts, {label}, p50 / p99 ms: " + ", ".join(
        f"{name} {1e3 * percentile(parts[name], 50):.1f} / {1e3 * percentile(parts[name], 99):.1f}"
        for name in TTFT_PARTS if parts[name]))


@contextmanager
def fleet(args: argparse.Namespace, folder: Path, out: Path, flags: list[str]) -> Iterator[Fleet]:
    """`tokenfleet up` with `flags` (its logs and step trace in `out`), ready and warm."""
    out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="tokenfleet-mixed-home-"))
    os.environ["TOKENFLEET_HOME"] = str(home)
    trace = out / "steps.jsonl"
    os.environ[STEP_TRACE_ENV] = str(trace)  # a line per engine step (scheduler/step_trace.py)
    children = Children(out)
    port = free_port()
    children.spawn("up", [sys.executable, "-m", "tokenfleet.cli", "up", "--model", str(folder),
                          "--model-name", MODEL_NAME, "--port", str(port), *flags])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, children, timeout_s=900)
        warm = chat_args(args, url, 4.0)
        warm.duration = 2.0
        asyncio.run(fleet_bench.run(warm))
        redis_url = redis_url_of(out / "up.log")  # (announced once up is ready: read after the warm-up)
        client = redis.Redis.from_url(redis_url)
        log(f"fleet ready and warm: tokenfleet up {' '.join(flags)}")
        with mixed.TokenMeter(redis_url) as meter:
            yield Fleet(url, redis_url, client, trace, meter)
        client.close()
    finally:
        children.stop()
        shutil.rmtree(home, ignore_errors=True)


def chats_beside(args: argparse.Namespace, at: Fleet, lines: list[str], slowdown: float | None,
                 *, run_to_end: bool) -> MixedRun:
    """The chats beside the running job `mixed-1` (a second job cancelled mid-run); then the job
    run to its end (`run_to_end`) or cancelled."""
    mixed.submit_job(at.client, "mixed-cancel", lines[: args.cancel_lines])
    # (Its lines queue behind the first job's: it may start only after the chats.)
    canceller = mixed.CancelWhenWritten(at.redis_url, at.url, "mixed-cancel", max(1, args.cancel_lines // 10),
                                        timeout_s=max(60.0, 3 * args.seconds))
    canceller.start()
    results, span = run_chats(args, at.url)
    beside = mixed.ChatLatency.of(results)
    label = "beside the batch job" + ("" if slowdown is None else f", --itl-slowdown {slowdown:g}")
    window = span.window(f"chats {label}", at)
    log(f"chats {label}: {beside}; {window.line()}")
    log_ttft_parts(label, at.redis_url, results, args.logs and args.logs / f"chats_beside_{slowdown}.json")
    if mixed.job_status(at.client, "mixed-1").get("status") in mixed.JOB_END_STATUSES:
        log("warning: the batch job ended before the chats did: make --batch-lines larger")
    cancelled = False if run_to_end else mixed.cancel_job(at.url, "mixed-1")
    canceller.join()
    log(f"second job cancelled with {canceller.num_written_at_cancel} of its lines written"
        if canceller.cancelled else "second job ended before its cancel")
    mixed.wait_job_end(at.client, "mixed-1", timeout_s=args.job_timeout_s)
    mixed.wait_job_end(at.client, "mixed-cancel", timeout_s=120)
    checks = [mixed.check_job(at.client, "mixed-1", len(lines), cancelled=cancelled,
                              max_tokens=args.batch_tokens),
              mixed.check_job(at.client, "mixed-cancel", args.cancel_lines, cancelled=canceller.cancelled,
                              max_tokens=args.batch_tokens)]
    return MixedRun(slowdown, beside, window, checks, mixed.step_costs(at.client))


def run(args: argparse.Namespace, folder: Path, out: Path) -> MixedBench:
    """The chats alone, the batch job alone and the chats beside it on the first fleet; the chats
    beside the job again on a fleet for each further --itl-slowdown value."""
    lines = mixed.batch_lines(args.batch_lines, MODEL_NAME, words=args.batch_words,
                              max_tokens=args.batch_tokens, seed=0)
    slowdowns: list[float | None] = list(args.itl_slowdown) or [None]
    runs: list[MixedRun] = []
    for i, slowdown in enumerate(slowdowns):
        flags = [*args.up_flag] + ([] if slowdown is None else [f"--itl-slowdown={slowdown:g}"])
        with fleet(args, folder, out / f"fleet-{i}", flags) as at:
            if i == 0:
                alone_results, alone_span = run_chats(args, at.url)
                alone = mixed.ChatLatency.of(alone_results)
                log(f"chats alone: {alone} ({alone_span.seconds:.1f} s)")
                log_ttft_parts("alone", at.redis_url, alone_results,
                               args.logs and args.logs / "chats_alone.json")
            mixed.submit_job(at.client, "mixed-1", lines)
            time.sleep(args.lead_s)  # its ramp: every slot filled
            written = mixed.num_written(at.client, "mixed-1")
            log(f"batch job in for {args.lead_s:g} s: {written} lines written")
            if i == 0:
                # The batch job alone at its steady state, over as long as the chats alone took
                # (the chats beside it take about as long: both windows' lengths are printed).
                started = time.perf_counter()
                time.sleep(alone_span.seconds)
                batch_alone = Span.since(started).window("the batch job alone", at)
                log(batch_alone.line())
            runs.append(chats_beside(args, at, lines, slowdown, run_to_end=i == 0))
    return MixedBench(alone, batch_alone, runs, len(lines))
