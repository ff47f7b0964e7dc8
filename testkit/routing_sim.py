"""sim_routing.py's simulation: replicas whose caches are real BlockManagers and whose summaries
are the real PrefixSummary, requests routed by the gateway's own choose_replica (or, without
routing, pulled by the replica with the most free slots); time counted in arrivals."""

from __future__ import annotations

import argparse
import bisect
import collections
import random
from types import SimpleNamespace

from gateway.fleet.routing import ReplicaView, choose_replica
from protocol.prefix_hash import SUMMARY_HASH_BYTES
from scheduler.block_manager import SUMMARY_DEPTH_BLOCKS, BlockManager
from scheduler.request import Request
from service.prefix_summary import PrefixSummary
from shared.sampling import SamplingParams

VOCAB = 49_152


class Replica:
    def __init__(self, name: str, num_blocks: int, block_size: int, max_num_seqs: int) -> None:
        self.name = name
        self.blocks = BlockManager(num_blocks, block_size)
        self.summary = PrefixSummary(SimpleNamespace(block_manager=self.blocks, host_tier=None,
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


def simulate(args: argparse.Namespace, *, routing: bool) -> dict:
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
