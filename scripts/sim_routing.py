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
import bisect
import collections
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.fleet.routing import ReplicaView, choose_replica  # noqa: E402
from protocol.prefix_hash import SUMMARY_HASH_BYTES  # noqa: E402
from scheduler.block_manager import SUMMARY_DEPTH_BLOCKS, BlockManager  # noqa: E402
from scheduler.request import Request  # noqa: E402
from service.prefix_summary import PrefixSummary  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402

VOCAB = 49_152


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


class Replica:
    def __init__(self, name: str, num_blocks: int, block_size: int, max_num_seqs: int) -> None:
        self.name = name
        self.blocks = BlockManager(num_blocks, block_size)
        self.summary = PrefixSummary(SimpleNamespace(block_manager=self.blocks,
                                                     config=SimpleNamespace(block_size=block_size)))
        self.max_num_seqs = max_num_seqs
        self.ends: list[int] = []  # arrival index at which each running request ends, sorted
        self.served = 0

    def running(self, now: int) -> int:
        del self.ends[:bisect.bisect_right(self.ends, now)]
        return len(self.ends)

    def serve(self, req_id: str, tokens: list[int], now: int, service: int) -> tuple[int, int]:
        """Admit, compute and finish a request (its K/V stays cached); (tokens looked up, found)."""
        request = Request(req_id, tokens, SamplingParams())
        cached = self.blocks.find_cached_prefix(request)
        size = self.blocks.block_size
        if not self.blocks.allocate_slots(request, len(tokens) - len(cached) * size, cached):
            raise RuntimeError("a prompt larger than a replica's cache: raise --cache-prompts")
        hits = request.num_computed_tokens
        request.num_computed_tokens = len(tokens)
        self.blocks.register_full_blocks(request)
        self.blocks.free(request)
        bisect.insort(self.ends, now + service)
        self.served += 1
        return len(tokens), hits

    def view(self, now: int) -> ReplicaView:
        blob = self.summary.build()
        prefixes = frozenset(blob[i:i + SUMMARY_HASH_BYTES] for i in range(0, len(blob), SUMMARY_HASH_BYTES))
        return ReplicaView(self.name, self.blocks.block_size, SUMMARY_DEPTH_BLOCKS, prefixes,
                           num_running=self.running(now), max_num_seqs=self.max_num_seqs)


def simulate(args, *, routing: bool) -> dict:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(3, VOCAB) for _ in range(args.system_tokens)] for _ in range(args.prompts)]
    weights = [1 / (k + 1) ** args.zipf for k in range(args.prompts)]
    draws = random.Random(args.seed + 1).choices(range(args.prompts), weights, k=args.requests)
    users = random.Random(args.seed + 2)
    blocks_per_prompt = -(-(args.system_tokens + args.user_tokens) // args.block_size)
    num_blocks = max(blocks_per_prompt, int(args.cache_prompts * blocks_per_prompt))
    replicas = [Replica(f"r{i}", num_blocks, args.block_size, args.max_num_seqs)
                for i in range(args.replicas)]
    by_name = {r.name: r for r in replicas}
    pick = random.Random(args.seed + 3)
    decisions: collections.Counter = collections.Counter()
    queried = found = 0
    views: list[ReplicaView] = []
    measured_from = int(args.warmup * args.requests)
    for now, prompt in enumerate(draws):
        tokens = systems[prompt] + [users.randrange(3, VOCAB) for _ in range(args.user_tokens)]
        if now % args.refresh_every == 0:
            views = [r.view(now) for r in replicas] if routing else []
        replica = None
        if routing:
            route = choose_replica(tokens, views)
            decisions[route.decision] += 1
            if route.scheduler_id is not None:
                replica = by_name[route.scheduler_id]
                next(v for v in views if v.scheduler_id == replica.name).backlog += 1  # as PrefixRouter
        if replica is None:  # the shared stream: whoever has the most free slots pulls it
            free = [r.max_num_seqs - r.running(now) for r in replicas]
            best = max(free)
            replica = pick.choice([r for r, f in zip(replicas, free, strict=True) if f == best])
        looked_up, hits = replica.serve(f"q{now}", tokens, now, args.service)
        if now >= measured_from:
            queried += looked_up
            found += hits
    served = [r.served for r in replicas]
    return {"hit_rate": found / queried, "decisions": dict(decisions),
            "max_share": max(served) / sum(served), "min_share": min(served) / sum(served)}


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
