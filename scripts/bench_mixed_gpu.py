"""Chats beside a batch job: the chats' latency alone and beside a running batch job, and the
fleet's output while both run against the batch job alone, on one `tokenfleet up` (default flags).

    python3 scripts/bench_mixed_gpu.py --tokenizer DIR           # one H200, ~6 min
    .venv/bin/python scripts/bench_mixed_gpu.py --smoke          # this CPU, tiny model: checks the script

Model: Llama-3-8B's shape with SmolLM2's vocabulary and tokenizer, random bf16 weights (as
scripts/bench_serve_gpu.py builds it). Chats: `tokenfleet bench`'s plan at --rate for --seconds
(Poisson, seed 0): streamed /v1/chat/completions with one shared system prompt of --prefix-tokens
words, a user turn of 40-300 words, 16-512 output tokens (lognormal, mean 150), greedy, EOS
ignored. Batch job: --batch-lines chat lines written to tf:batch:in by a plain Redis client, a
user turn of 150-400 words, 256 greedy output tokens each.

1. The chats alone.
2. The batch job, and --lead-s later (its slots filled) the same chats beside it; a second job of
   --cancel-lines lines goes in with the chats and is cancelled once some of its lines are written.
   The first job runs to its end.
3. The batch job alone again (a third job of the same lines), metered over --seconds from --lead-s
   after it went in, then cancelled.

The fleet's output is metered from its scheduler's heartbeats (tf:sched:{id}, num_generation_tokens):
while the chats run in step 2, and over the same window of step 3. Every job's output lines are
checked: each line written exactly once (answered with its 256 tokens, or cancelled). Prints the
command line first and the table last; exits 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import redis

from scheduler.step_trace import ENV_VAR as STEP_TRACE_ENV
from shared.net import free_port
from testkit import mixed_traffic as mixed
from testkit.fleet_paths import prepare_model
from testkit.processes import Children, wait_ready
from testkit.runs import log, percentile, print_command, raise_fd_limit
from testkit.serve_runs import MODEL_NAME, TTFT_PARTS, bench_args, redis_url_of, ttft_parts
from tokenfleet import bench as fleet_bench


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


def run(args: argparse.Namespace, folder: Path, out: Path) -> bool:
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
    low, high = args.batch_words
    print(f"\nChats at {args.rate:g} req/s for {args.seconds:g} s (shared prefix {args.prefix_tokens} "
          f"words), alone and beside a batch job of {len(lines):,} lines ({low}-{high} words, "
          f"{args.batch_tokens} output tokens); `tokenfleet up {' '.join(args.up_flag)}`\n")
    return mixed.print_table(alone, beside, both_tok_s, batch_tok_s, checks, costs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on this CPU, small and short")
    parser.add_argument("--tokenizer",
                        help="folder with SmolLM2's tokenizer files (default: the default model's)")
    parser.add_argument("--rate", type=float, default=32.0, help="chats per second")
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="of chat arrivals, and of the batch alone")
    parser.add_argument("--prefix-tokens", type=int, default=800)
    parser.add_argument("--chat-max-tokens", default="16-512:lognormal:150",
                        help="the chats' output tokens (tokenfleet bench's --max-tokens)")
    parser.add_argument("--batch-lines", type=int, default=4000)
    parser.add_argument("--batch-words", type=lambda t: tuple(int(w) for w in t.split("-")),
                        default=(150, 400), help="LOW-HIGH words of a batch line's prompt")
    parser.add_argument("--batch-tokens", type=int, default=256)
    parser.add_argument("--cancel-lines", type=int, default=200, help="lines of the job cancelled mid-run")
    parser.add_argument("--lead-s", type=float, default=8.0,
                        help="how long a batch job runs before the chats (or the meter) start")
    parser.add_argument("--job-timeout-s", type=float, default=300.0)
    parser.add_argument("--client-processes", type=int, default=4)
    parser.add_argument("--up-flag", action="append", default=[],
                        help="a flag for `tokenfleet up` (repeat; e.g. --up-flag=--itl-target-ms=12)")
    parser.add_argument("--logs", type=Path, help="folder for the fleet's logs (default: a temp folder)")
    args = parser.parse_args(argv)
    args.quantization, args.kv_cache_dtype = None, "auto"  # (prepare_model's, bench_serve_gpu's)
    print_command()
    if args.smoke:
        args.device, args.rate, args.seconds, args.prefix_tokens = "cpu", 2.0, 4.0, 100
        args.chat_max_tokens = "8-24"
        args.batch_lines, args.batch_words, args.batch_tokens = 60, (20, 40), 16
        args.cancel_lines, args.lead_s, args.client_processes = 20, 2.0, 1
    raise_fd_limit(4096)
    folder = Path(tempfile.mkdtemp(prefix="tokenfleet-mixed-model-"))
    out = args.logs or Path(tempfile.mkdtemp(prefix="tokenfleet-mixed-logs-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        log(prepare_model(args, folder))
        met = run(args, folder, out)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    sys.stdout.flush()
    if not met and not args.smoke:
        sys.exit(1)


if __name__ == "__main__":
    main()
