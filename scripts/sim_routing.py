"""The fleet-wide prefix-cache hit rate of N replicas on a Zipf-distributed set of system prompts,
with prefix-aware routing and without, from the real parts: each replica's cache is a real
BlockManager (scheduler/block_manager.py), its summary the real PrefixSummary, and the choice
the gateway's own choose_replica (gateway/fleet/routing.py). No model, no Redis: seconds on a CPU.

    .venv/bin/python scripts/sim_routing.py                       # 16 replicas, 1,000 prompts
    .venv/bin/python scripts/sim_routing.py --replicas 4 --zipf 0.8

Requests arrive one at a time: a system prompt drawn from Zipf(--zipf) over --prompts prompts
of --system-tokens tokens, then a distinct user turn of --user-tokens. Time is counted in
arrivals. A request runs for --service arrivals (holding a sequence slot of its replica, whose
load routing weighs; the K/V it computed stays cached after it ends). Summaries and loads reach
the router every --refresh-every arrivals (the heartbeat's delay). Without routing a request
goes to the replica with the most free slots (ties at random), as pull-based intake does.
Reported over the arrivals after the first --warmup fraction: the hit rate (prompt tokens found
in a cache / prompt tokens looked up, vLLM's counters) and how evenly the replicas were loaded.
"""

from __future__ import annotations

import argparse
import sys
import time

import _repo  # noqa: F401 - first: it puts the repository on sys.path

from testkit.routing_sim import simulate


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=1000, help="distinct system prompts")
    parser.add_argument("--zipf", type=float, default=1.0, help="exponent s: P(rank k) ~ 1/k^s")
    parser.add_argument("--requests", type=int, default=30_000)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cache-prompts", type=float, default=50,
                        help="each replica's KV cache, in system prompts' worth of blocks")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="sequence slots per replica")
    parser.add_argument("--service", type=int, default=96, help="arrivals a request runs for")
    parser.add_argument("--refresh-every", type=int, default=32, help="arrivals between summaries")
    parser.add_argument("--warmup", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    print(f"{args.replicas} replicas, {args.prompts} system prompts of {args.system_tokens} tokens, "
          f"Zipf s={args.zipf}, {args.requests} requests (+{args.user_tokens} user tokens each); each "
          f"cache holds {args.cache_prompts:g} prompts, {args.max_num_seqs} slots, requests run for "
          f"{args.service} arrivals, summaries every {args.refresh_every} arrivals, seed {args.seed}")
    print("| routing | hit rate | busiest replica's share | idlest replica's share | decisions |")
    print("| --- | ---: | ---: | ---: | --- |")
    for routing in (False, True):
        started = time.perf_counter()
        result = simulate(args, routing=routing)
        decisions = ", ".join(f"{k} {v}" for k, v in sorted(result["decisions"].items())) or "-"
        print(f"| {'prefix' if routing else 'none'} | {100 * result['hit_rate']:.1f}% | "
              f"{100 * result['max_share']:.1f}% | {100 * result['min_share']:.1f}% | {decisions} |"
              f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
