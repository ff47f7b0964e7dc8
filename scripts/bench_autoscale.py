"""Elastic replicas against fixed ones: a step load, in one run. Run by hand (not a test):

    .venv/bin/python scripts/bench_autoscale.py [--step-s 30] [--load-factor 4] [--max-replicas 2]

Method. The model is a tiny random llama with SmolLM2's tokenizer (a step costs milliseconds,
so the fleet's behaviour is measured, not the model), unless --model names a folder. Requests
go straight into the Redis stream (no gateway), greedy, --max-tokens each, EOS ignored.
1. A replica's capacity: one `tokenfleet scheduler` process serves a burst of
   8 x --max-num-seqs requests; capacity = requests / seconds until the stream is empty.
2. The same step load for each fleet: --idle-s with nothing, then --step-s at --load-factor x
   that capacity (evenly spaced arrivals), then nothing until every request ended and
   --tail-s more. Fleets: fixed 1 replica, fixed 2 replicas, and the autoscaler (1 to
   --max-replicas, the controller of `tokenfleet up --min-replicas`, scheduler processes).
Queue wait = the scheduler's start of a request (tf:res started_at) minus its arrival time.
Replicas over time: live heartbeats that are not draining, sampled every 0.5 s; replica-seconds
is their integral over the run (what the fleet held).
"""

from __future__ import annotations

import argparse

import _repo  # noqa: F401 - first: it puts the repository on sys.path

from testkit.autoscale_runs import Run, compare_fleets
from testkit.runs import percentile, print_command


def print_table(runs: list[Run], capacity: float, rate: float, args: argparse.Namespace) -> None:
    base = runs[0]
    print(f"\nreplica capacity {capacity:.2f} req/s ({args.max_tokens} tokens each, --max-num-seqs "
          f"{args.max_num_seqs}); step {args.step_s:g} s at {rate:.2f} req/s ({args.load_factor:g}x)")
    print(f"{'fleet':<16} {'requests':>8} {'wait p50 s':>10} {'wait p99 s':>10} {'p99 vs fixed 1':>15} "
          f"{'replica-s':>10} {'peak':>5}")
    for run in runs:
        p50, p99 = percentile(run.waits, 50), percentile(run.waits, 99)
        ratio = p99 / percentile(base.waits, 99) if percentile(base.waits, 99) else float("nan")
        peak = max((n for _, n in run.replicas), default=0)
        print(f"{run.name:<16} {len(run.waits):>8} {p50:>10.2f} {p99:>10.2f} {ratio:>15.2f} "
              f"{run.replica_seconds:>10.0f} {peak:>5}")
    print("\nreplicas over time (most serving per 2 s; the step starts at "
          f"{args.idle_s:g} s and ends at {args.idle_s + args.step_s:g} s):")
    for run in runs:
        print(f"  {run.name:<16} {run.timeline(2.0)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: a tiny llama with SmolLM2's tokenizer)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=4, help="slots per replica")
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--step-s", type=float, default=30.0)
    parser.add_argument("--tail-s", type=float, default=20.0, help="idle after the last request ended")
    parser.add_argument("--load-factor", type=float, default=4.0,
                        help="the step's rate, x one replica's capacity")
    parser.add_argument("--max-replicas", type=int, default=2)
    parser.add_argument("--target-queue", type=float, default=4.0)
    parser.add_argument("--target-wait-s", type=float, default=2.0)
    parser.add_argument("--scale-up-cooldown-s", type=float, default=2.0)
    parser.add_argument("--scale-down-cooldown-s", type=float, default=10.0)
    args = parser.parse_args()
    print_command()
    capacity, rate, runs, work = compare_fleets(args)
    print_table(runs, capacity, rate, args)
    print(f"(logs in {work})")


if __name__ == "__main__":
    main()
