"""bench_mixed_gpu.py's run on one `tokenfleet up`: `tokenfleet bench`'s chats alone, then beside
a running batch job (a second job cancelled mid-run), then the batch job alone metered over the
same window; every job's output lines checked (testkit/mixed_traffic.py holds the parts)."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from scheduler.step_trace import ENV_VAR as STEP_TRACE_ENV
from shared.net import free_port
from testkit import mixed_traffic as mixed
from testkit.processes import Children, wait_ready
from testkit.runs import log, percentile
from testkit.serve_runs import MODEL_NAME, TTFT_PARTS, bench_args, redis_url_of, ttft_parts
from tokenfleet import bench as fleet_bench


@dataclass
class MixedRun:
    alone: mixed.ChatLatency  # the chats alone
    beside: mixed.ChatLatency  # the same chats beside the batch job
    both_tok_s: float  # the fleet's output while both ran
    batch_tok_s: float  # the batch job's alone, over the same window
    checks: list[mixed.JobCheck]
    costs: list[list[list[float]]]  # mixed_traffic.step_costs
    num_lines: int  # of each batch job


def chat_args(args: argparse.Namespace, url: str, rate: float) -> argparse.Namespace:
    """`tokenfleet bench`'s flags (bench_serve_gpu.py's chats), with --chat-max-tokens."""
    chats = bench_args(args, url, rate)
    chats.max_tokens = args.chat_max_tokens
    return chats


def run_chats(args: argparse.Namespace, url: str) -> tuple[list, float, float]:
    """The planned chats; their results, and when they started and ended (perf_counter)."""
    started = time.perf_counter()
    results, _, _ = asyncio.run(fleet_bench.run(chat_args(args, url, args.rate)))
    return results, started, time.perf_counter()


def log_ttft_parts(label: str, redis_url: str, results: list, dump: Path | None) -> None:
    """The chats' TTFT cut at their records' timestamps (gateway, queue, engine, delivery): where
    a tail comes from (with --logs, each chat's timestamps too, beside the step trace)."""
    parts = ttft_parts(redis_url, results, dump)
    log(f"TTFT parts, {label}, p50 / p99 ms: " + ", ".join(
        f"{name} {1e3 * percentile(parts[name], 50):.1f} / {1e3 * percentile(parts[name], 99):.1f}"
        for name in TTFT_PARTS if parts[name]))


def run(args: argparse.Namespace, folder: Path, out: Path) -> MixedRun:
    """Steps 1 to 3 on one `tokenfleet up` (its logs in `out`)."""
    home = Path(tempfile.mkdtemp(prefix="tokenfleet-mixed-home-"))
    os.environ["TOKENFLEET_HOME"] = str(home)
    children = Children(out)
    if args.logs:  # a line per engine step, beside each chat's timestamps (scheduler/step_trace.py)
        os.environ[STEP_TRACE_ENV] = str(args.logs / "steps.jsonl")
    port = free_port()
    children.spawn("up", [sys.executable, "-m", "tokenfleet.cli", "up", "--model", str(folder),
                          "--model-name", MODEL_NAME, "--port", str(port), *args.up_flag])
    lines = mixed.batch_lines(args.batch_lines, MODEL_NAME, words=args.batch_words,
                              max_tokens=args.batch_tokens, seed=0)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, children, timeout_s=900)
        warm = chat_args(args, url, 4.0)
        warm.duration = 2.0
        asyncio.run(fleet_bench.run(warm))
        redis_url = redis_url_of(out / "up.log")  # (announced once up is ready: read after the warm-up)
        client = redis.Redis.from_url(redis_url)
        log("fleet ready and warm")

        alone_results = run_chats(args, url)[0]
        alone = mixed.ChatLatency.of(alone_results)
        log(f"chats alone: {alone}")
        log_ttft_parts("alone", redis_url, alone_results, args.logs and args.logs / "chats_alone.json")

        with mixed.TokenMeter(redis_url) as meter:
            mixed.submit_job(client, "mixed-1", lines)
            time.sleep(args.lead_s)
            log(f"batch job in for {args.lead_s:g} s: {mixed.num_written(client, 'mixed-1')} lines written")
            mixed.submit_job(client, "mixed-cancel", lines[: args.cancel_lines])
            # (Its lines queue behind the first job's: it may start only after the chats.)
            at_least = max(1, args.cancel_lines // 10)
            canceller = mixed.CancelWhenWritten(redis_url, url, "mixed-cancel", at_least,
                                                timeout_s=max(60.0, 3 * args.seconds))
            canceller.start()
            results, started, ended = run_chats(args, url)
            beside = mixed.ChatLatency.of(results)
            both_tok_s = meter.rate(started, ended)
            log(f"chats beside the batch: {beside}; the fleet's output {both_tok_s:,.0f} tok/s")
            log_ttft_parts("beside the batch job", redis_url, results,
                           args.logs and args.logs / "chats_beside.json")
            canceller.join()
            log(f"second job cancelled with {canceller.num_written_at_cancel} of its lines written"
                if canceller.cancelled else "second job ended before its cancel")
            if mixed.job_status(client, "mixed-1").get("status") in mixed.JOB_END_STATUSES:
                log("warning: the batch job ended before the chats did: make --batch-lines larger")
            mixed.wait_job_end(client, "mixed-1", timeout_s=args.job_timeout_s)
            mixed.wait_job_end(client, "mixed-cancel", timeout_s=120)
            log("batch job done")

            mixed.submit_job(client, "mixed-alone", lines)
            time.sleep(args.lead_s)
            window_start = time.perf_counter()
            time.sleep(args.seconds)
            batch_tok_s = meter.rate(window_start, time.perf_counter())
            log(f"the batch job alone: {batch_tok_s:,.0f} tok/s")
            alone_cancelled = mixed.cancel_job(url, "mixed-alone")
            mixed.wait_job_end(client, "mixed-alone", timeout_s=120)
        costs = mixed.step_costs(client)
        checks = [mixed.check_job(client, "mixed-1", len(lines), max_tokens=args.batch_tokens),
                  mixed.check_job(client, "mixed-cancel", args.cancel_lines, cancelled=canceller.cancelled,
                                  max_tokens=args.batch_tokens),
                  mixed.check_job(client, "mixed-alone", len(lines), cancelled=alone_cancelled,
                                  max_tokens=args.batch_tokens)]
        client.close()
    finally:
        children.stop()
        shutil.rmtree(home, ignore_errors=True)
    return MixedRun(alone, beside, both_tok_s, batch_tok_s, checks, costs, len(lines))
