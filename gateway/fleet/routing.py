"""Prefix-aware routing: a chat goes to the replica whose KV cache holds the longest run of its
first blocks, weighed against that replica's load, through that replica's own stream.

Every scheduler publishes at its heartbeat the (truncated) hashes of its cached chains' first
blocks (service/prefix_summary.py). The gateway hashes the prompt's first full blocks with the
block manager's own function (protocol/prefix_hash.py, at each replica's block size) and counts
the leading ones each replica names: its match, in tokens, capped as the block manager caps a
hit (the last token is always computed), a block named among its host KV tier's counting
HOST_TIER_WEIGHT of one in its GPU cache (protocol/prefix_hash.py). Then:

- no replica matches, or one replica serves the model: the shared stream, where whichever
  scheduler has room pulls it, as without routing;
- some replicas match more than the least: among them, those with a free slot (running +
  waiting + their own stream's backlog below max_num_seqs) compete on match / best match -
  LOAD_WEIGHT * load; none with a free slot: the shared stream ("overloaded");
- every replica matches as much: a short match (under CONSOLIDATE_FRACTION of the prompt's
  blocks, such as the chat template's first block, which every replica holds) gains nothing
  from routing: the shared stream. A long one (chats that reached several replicas before any
  had published the prefix) goes to one replica chosen by rendezvous hashing on the prefix, the
  same one from every gateway each time (the first with a free slot in that order), so the
  other copies age out of their caches and the fleet keeps one.
Ties are broken by the same rendezvous order, so gateways agree.

A request on a LoRA adapter is routed by the adapter instead (its KV blocks chain from the
adapter's own root, which the summaries' hashes do not show): to the least loaded replica with a
free slot whose heartbeat says the adapter sits in a device slot there, when only some replicas
hold it (rendezvous order on the adapter's name breaks ties); else the shared stream.

The summaries are a heartbeat old, so a burst of chats with a new prefix goes to the shared
stream until one replica has cached it; the backlog counts what this gateway routed since the
last read of the fleet, so a burst with a known prefix does not pile onto one replica unseen.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from protocol.prefix_hash import HOST_TIER_WEIGHT, BlockHash, block_hashes, summary_hash

LOAD_WEIGHT = 0.5  # a full match on a replica at load 1 scores as half a match on an idle one
CONSOLIDATE_FRACTION = 0.5  # a match every replica has is worth one copy only if this long
DECISIONS = ("routed", "no_match", "overloaded", "single", "lora")


@dataclass
class ReplicaView:
    scheduler_id: str
    block_size: int
    depth: int  # blocks of each chain its summary covers
    prefixes: frozenset[bytes]  # summary hashes (protocol.prefix_hash.summary_hash)
    num_running: int = 0
    num_waiting: int = 0
    max_num_seqs: int = 1
    backlog: int = 0  # unread entries of its own stream, and what this gateway routed there since
    draining: bool = False
    loras: frozenset[str] = frozenset()  # the LoRA adapters in its device slots
    host_prefixes: frozenset[bytes] = frozenset()  # summary hashes of its host KV tier's blocks

    @property
    def num_queued(self) -> int:
        return self.num_running + self.num_waiting + self.backlog

    @property
    def load(self) -> float:
        return self.num_queued / max(1, self.max_num_seqs)

    @property
    def has_room(self) -> bool:
        return self.num_queued < self.max_num_seqs


@dataclass(frozen=True)
class Route:
    scheduler_id: str | None  # None: the shared stream
    decision: str  # one of DECISIONS
    matched_tokens: int = 0


def matched_blocks(hashes: list[BlockHash], prefixes: frozenset[bytes]) -> int:
    """How many leading blocks the summary names (the block manager stops at the first miss)."""
    for index, block_hash in enumerate(hashes):
        if summary_hash(block_hash) not in prefixes:
            return index
    return len(hashes)


def choose_by_adapter(lora_name: str, candidates: list[ReplicaView]) -> Route:
    holders = [r for r in candidates if lora_name in r.loras]
    if not holders or len(holders) == len(candidates):
        return Route(None, "no_match")  # any replica will do as well: whichever has room pulls it
    scored = [(-r.load, hashlib.sha256(lora_name.encode() + r.scheduler_id.encode()).digest(), r.scheduler_id)
              for r in holders if r.has_room]
    if not scored:
        return Route(None, "overloaded")
    return Route(max(scored)[-1], "lora")


def choose_replica(prompt_token_ids: list[int], replicas: list[ReplicaView], *,
                   load_weight: float = LOAD_WEIGHT, lora_name: str | None = None) -> Route:
    candidates = [r for r in replicas if not r.draining]
    if len(candidates) < 2:
        return Route(None, "single")
    if lora_name is not None:
        return choose_by_adapter(lora_name, candidates)
    hashes: dict[int, list[BlockHash]] = {}  # block size -> the prompt's hashes (replicas mostly agree)
    matches: dict[str, float] = {}  # replica -> its match in tokens, host-tier blocks weighted
    num_blocks: dict[str, int] = {}  # replica -> the leading blocks it holds in either tier
    matchable = 0  # tokens a hit could cover at most
    for replica in candidates:
        size = replica.block_size
        max_blocks = max(0, min(replica.depth, (len(prompt_token_ids) - 1) // size))
        known = hashes.get(size, [])
        if len(known) < max_blocks:
            known = hashes[size] = block_hashes(prompt_token_ids, size, max_blocks)
        num_matched = matched_blocks(known[:max_blocks], replica.prefixes)
        num_host = matched_blocks(known[num_matched:max_blocks], replica.host_prefixes)
        num_blocks[replica.scheduler_id] = num_matched + num_host
        matches[replica.scheduler_id] = (num_matched + HOST_TIER_WEIGHT * num_host) * size
        matchable = max(matchable, max_blocks * size)
    best, least = max(matches.values()), min(matches.values())
    if best == 0 or (best == least and best < CONSOLIDATE_FRACTION * matchable):
        return Route(None, "no_match")
    # The rendezvous order of the replicas for this prefix: the same in every gateway.
    key = next(hashes[r.block_size][num_blocks[r.scheduler_id] - 1]
               for r in candidates if matches[r.scheduler_id] == best)
    rank = {r.scheduler_id: hashlib.sha256(key + r.scheduler_id.encode()).digest() for r in candidates}
    if best == least:  # every replica holds it: one copy is enough
        scored = [(rank[r.scheduler_id], r.scheduler_id) for r in candidates if r.has_room]
    else:
        scored = [(matches[r.scheduler_id] / best - load_weight * r.load, rank[r.scheduler_id],
                   r.scheduler_id) for r in candidates if matches[r.scheduler_id] > least and r.has_room]
    if not scored:
        return Route(None, "overloaded", round(best))
    chosen = max(scored)[-1]
    return Route(chosen, "routed", round(matches[chosen]))


class PrefixRouter:
    """The gateway's routing state: each model's replicas as last read (gateway/fleet/tracker.py)."""

    def __init__(self, metrics=None) -> None:
        self.metrics = metrics  # GatewayMetrics, or None
        self.replicas: dict[str, list[ReplicaView]] = {}  # model -> its live replicas

    def update(self, model: str, replicas: list[ReplicaView]) -> None:
        self.replicas[model] = replicas

    def route(self, model: str, prompt_token_ids: list[int], lora_name: str | None = None) -> Route:
        replicas = self.replicas.get(model, [])
        route = choose_replica(prompt_token_ids, replicas, lora_name=lora_name)
        if route.scheduler_id is not None:
            next(r for r in replicas if r.scheduler_id == route.scheduler_id).backlog += 1
        if self.metrics is not None:
            self.metrics.routing_decisions.labels(model, route.decision).inc()
        return route
