"""Chats beside a batch job: the chats' latency alone and beside a running batch job, and the
fleet's output while both run against the batch job alone at its steady state, on `tokenfleet up`
(default flags, or each --itl-slowdown value in turn).

    python3 scripts/bench_mixed_gpu.py --tokenizer DIR           # one H100 or H200, ~6 min
    python3 scripts/bench_mixed_gpu.py --tokenizer DIR --itl-slowdown 1.2,1.4,2.0   # the curve
    .venv/bin/python scripts/bench_mixed_gpu.py --smoke          # this CPU, tiny model: checks the script

Model: Llama-3-8B's shape with SmolLM2's vocabulary and tokenizer, random bf16 weights (as
scripts/bench_serve_gpu.py builds it). Chats: `tokenfleet bench`'s plan at --rate for --seconds
(Poisson, seed 0): streamed /v1/chat/completions with one shared system prompt of --prefix-tokens
words, a user turn of 40-300 words, 16-512 output tokens (lognormal, mean 150), greedy, EOS
ignored. Batch job: --batch-lines chat lines written to tf:batch:in by a plain Redis client, a
user turn of 150-400 words, 256 greedy output tokens each.

1. The chats alone.
2. The batch job; --lead-s later (its ramp: every slot filled) the batch job alone is metered over
   as long as the chats alone took (its steady state); then the same chats beside it, and a
   second job of --cancel-lines lines goes in with the chats and is cancelled once some of its
   lines are written. The first job runs to its end.
3. With several --itl-slowdown values, a fleet for each further value: the batch job, and
   --lead-s later the chats beside it; the job is cancelled after them. The chats alone and the
   batch job alone are measured once, on the first fleet (the slowdown changes neither).

The fleet's output is its schedulers' generated tokens (the counter behind
`generation_tokens_total`, read from their heartbeats, tf:sched:{id}), between the first and the
last heartbeat inside each window; both windows' lengths, engine step counts and tokens are
printed, with the rates of each window's two halves: a steady state has them within 10%, and a
window that is not level (a ramp not over, a job draining) is said to be so, since its ratio then
compares a ramp. Every engine writes its step trace (scheduler/step_trace.py) into the logs
folder: the steps that carried chats and batch work together are summarised (batch decode rows and
prefill tokens, chat rows and tokens, the context tokens read, the step cost model's predicted ms
against the measured ms). Every job's output lines are checked: each line written exactly once
(answered with its 256 tokens, or cancelled). Prints the command line first and the tables last;
exits 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path

from testkit import mixed_traffic as mixed
from testkit.fleet_paths import prepare_model
from testkit.mixed_runs import MixedBench, run
from testkit.runs import log, print_command, raise_fd_limit
from testkit.step_windows import mixed_summary


def slowdown_list(text: str) -> list[float]:
    """--itl-slowdown's values: numbers >= 1, comma-separated."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers >= 1 separated by commas, got {text!r}") from None
    if not values or any(not v >= 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers >= 1 separated by commas, got {text!r}")
    return values


def report(args: argparse.Namespace, bench: MixedBench) -> bool:
    """Each run's table, windows and mixed steps; the curve over the slowdowns. True: goals met."""
    low, high = args.batch_words
    met = True
    for run_ in bench.runs:
        flags = [*args.up_flag] + ([] if run_.slowdown is None else [f"--itl-slowdown={run_.slowdown:g}"])
        print(f"\n## Chats at {args.rate:g} req/s for {args.seconds:g} s (shared prefix {args.prefix_tokens} "
              f"words), alone and beside a batch job of {bench.num_lines:,} lines ({low}-{high} words, "
              f"{args.batch_tokens} output tokens); `tokenfleet up {' '.join(flags)}`\n")
        met = mixed.print_table(bench.alone, run_.beside, run_.window.tok_s, bench.batch_alone.tok_s,
                                run_.checks, run_.costs) and met
        print("\nWindows (the fleet's generated tokens between heartbeats; the engine steps in between):")
        print(f"- {bench.batch_alone.line()}")
        print(f"- {run_.window.line()}")
        print("\nThe steps while the chats ran beside the batch job (from the step trace):\n")
        print(mixed_summary(run_.window.steps))
    if len(bench.runs) > 1:
        print("\n## The curve: the chats beside the batch job, as ratios to the chats alone\n")
        print("| --itl-slowdown | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | output kept (of batch alone) |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for run_ in bench.runs:
            ratios = [getattr(run_.beside, a) / getattr(bench.alone, a)
                      for a in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")]
            print(f"| {'default' if run_.slowdown is None else f'{run_.slowdown:g}'} | "
                  + " | ".join(f"{r:.2f}x" for r in ratios)
                  + f" | {run_.window.tok_s / bench.batch_alone.tok_s:.2f} |")
    return met


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
    parser.add_argument("--itl-slowdown", type=slowdown_list, default=[],
                        help="comma-separated values: a run of the chats beside the batch job on a fleet "
                             "with each (e.g. 1.2,1.4,2.0); default: up's own")
    parser.add_argument("--up-flag", action="append", default=[],
                        help="a flag for `tokenfleet up` (repeat; e.g. --up-flag=--itl-target-ms=12)")
    parser.add_argument("--logs", type=Path, help="folder for the fleet's logs (default: a temp folder)")
    args = parser.parse_args(argv)
    args.quantization, args.kv_cache_dtype = None, "auto"  # (prepare_model's, bench_serve_gpu's)
    print_command()
    if args.smoke:
        args.device, args.rate, args.seconds, args.prefix_tokens = "cpu", 2.0, 4.0, 100
        args.chat_max_tokens = "8-24"
        args.batch_lines, args.batch_words, args.batch_tokens = 600, (20, 40), 16
        args.cancel_lines, args.lead_s, args.client_processes = 20, 2.0, 1
    raise_fd_limit(4096)
    folder = Path(tempfile.mkdtemp(prefix="tokenfleet-mixed-model-"))
    out = args.logs or Path(tempfile.mkdtemp(prefix="tokenfleet-mixed-logs-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        log(prepare_model(args, folder))
        result = run(args, folder, out)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    met = report(args, result)
    sys.stdout.flush()
    if not met and not args.smoke:
        sys.exit(1)


if __name__ == "__main__":
    main()
