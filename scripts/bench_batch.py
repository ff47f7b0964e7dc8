"""Batch jobs on a shared fleet, in one run (run by hand, not a test):

    .venv/bin/python scripts/bench_batch.py [--lines 128] [--max-tokens 32] [--max-num-seqs 16]
                                            [--max-num-batched-tokens 512]

1. Interactive time to first token on an idle fleet: `--interactive` streamed chat
   completions, one after another, through the gateway (its own process) and one scheduler
   (its own process), SmolLM2-135M-Instruct on this CPU.
2. The batch job alone: `--lines` chat lines (OpenAI Batch format, greedy, EOS ignored, fixed
   output length) written to tf:batch:in; timed from the XADD until the job is completed.
3. The same job again, and while it saturates the scheduler (every sequence slot taken), the
   same interactive requests: their time to first token against step 1's (goal: within 2x).
4. The in-process engine (same engine settings) on the very same prompt token ids and
   sampling: batch throughput through Redis against it (goal: at least 0.9).
The ingester runs inside the gateway process, as deployed.
"""

from __future__ import annotations

import argparse
import statistics

import _repo  # noqa: F401 - first: it puts the repository on sys.path

from testkit.batch_runs import batch_lines, in_process, run_fleet
from testkit.runs import print_command
from workers.default_model import fetch_default_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="tokens per step: on a CPU a step's time grows with it, and an arriving "
                             "interactive request waits for the step in progress")
    parser.add_argument("--interactive", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    print_command()
    model = str(fetch_default_model())
    lines = batch_lines(args.lines, args.max_tokens)
    fleet = run_fleet(args, model, lines)
    alone_s, alone_tokens = fleet.alone_s, fleet.alone_tokens
    shared_s, shared_tokens = fleet.shared_s, fleet.shared_tokens
    direct_s, direct_tokens = in_process(model, lines, args)
    idle_ms, loaded_ms = statistics.median(fleet.idle) * 1000, statistics.median(fleet.loaded) * 1000
    workload = (f"{args.lines} lines x {args.max_tokens} tokens, max_num_seqs {args.max_num_seqs}, "
                f"max_num_batched_tokens {args.max_num_batched_tokens}, {args.dtype}")
    print(f"\n| {workload} | seconds | output tok/s |")
    print("| --- | ---: | ---: |")
    print(f"| in-process engine (baseline) | {direct_s:.1f} | {direct_tokens / direct_s:.1f} |")
    print(f"| batch job through Redis, alone | {alone_s:.1f} | {alone_tokens / alone_s:.1f} |")
    print(f"| batch job with interactive traffic | {shared_s:.1f} | {shared_tokens / shared_s:.1f} |")
    print(f"| **batch / in-process** (goal >= 0.9) | | **{direct_s / alone_s:.2f}** |")
    print(f"\n| interactive TTFT ({args.interactive} streamed chats, median) | ms |")
    print("| --- | ---: |")
    print(f"| idle fleet | {idle_ms:.0f} |")
    print(f"| fleet saturated by the batch job | {loaded_ms:.0f} |")
    print(f"| **saturated / idle** (goal <= 2) | **{loaded_ms / idle_ms:.2f}** |")


if __name__ == "__main__":
    main()
