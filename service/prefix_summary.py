"""What a scheduler tells the gateways its KV cache holds, at each heartbeat.

`tf:prefixes:{id}` (with the heartbeat's TTL) is the concatenated first SUMMARY_HASH_BYTES of
the hashes of the blocks within the first SUMMARY_DEPTH_BLOCKS of their chains: first those of
the requests it has admitted (their blocks are being computed and will be cached: the next chat
with that prefix should come here rather than start a second copy elsewhere while the first is
still in prefill), then its cached ones, the most recently used first; at most `max_hashes`.
With a host KV tier, the hashes of the heads it holds follow (the heartbeat's
`prefix_summary_gpu_hashes` says how many come before them), so that the gateway weighs them
below GPU blocks (protocol.prefix_hash.HOST_TIER_WEIGHT).
The gateway hashes a prompt's first blocks with the same function (protocol/prefix_hash.py) and
counts how many leading ones a replica's summary names (gateway/fleet/routing.py). Its cost per
heartbeat is bounded by `max_hashes`, not by the cache's size (the block manager keeps the
heads in LRU order), plus hashing each admitted request's blocks once (which its admission
reuses); and measured: the heartbeat carries the summary's size and the time it took to build.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from protocol.prefix_hash import SUMMARY_HASH_BYTES
from scheduler.block_manager import SUMMARY_DEPTH_BLOCKS, update_block_hashes
from scheduler.request import Request
from scheduler.scheduler import Scheduler

# 4,096 hashes of 8 bytes: 32 KiB a heartbeat at most; 64 chains of 64 blocks, or more shorter ones.
SUMMARY_MAX_HASHES = 4096


class PrefixSummary:
    def __init__(self, scheduler: Scheduler, max_hashes: int = SUMMARY_MAX_HASHES) -> None:
        self.scheduler = scheduler
        self.max_hashes = max_hashes
        self.last_hashes = 0
        self.last_gpu_hashes = 0  # of last_hashes, those of the GPU cache (the host tier's follow)
        self.last_build_us = 0.0

    def build(self, admitted: Iterable[Request] = ()) -> bytes:
        """The summary, given the requests the scheduler runs or has waiting."""
        started = time.perf_counter()
        manager = self.scheduler.block_manager
        heads: dict[bytes, None] = {}  # (ordered, without repeats)
        if manager.enable_prefix_caching:
            block_size = self.scheduler.config.block_size
            for request in admitted:  # (hashes a request's blocks once: admission reuses them)
                for block_hash in update_block_hashes(request, block_size)[:SUMMARY_DEPTH_BLOCKS]:
                    heads[block_hash[:SUMMARY_HASH_BYTES]] = None
                if len(heads) >= self.max_hashes:
                    break
        for block_hash in manager.recent_head_hashes(self.max_hashes):
            if len(heads) >= self.max_hashes:
                break
            heads[block_hash[:SUMMARY_HASH_BYTES]] = None
        self.last_gpu_hashes = min(len(heads), self.max_hashes)
        host_tier = self.scheduler.host_tier
        if host_tier is not None:
            for block_hash in host_tier.recent_head_hashes(self.max_hashes - self.last_gpu_hashes):
                heads.setdefault(block_hash[:SUMMARY_HASH_BYTES], None)  # (GPU ones stay GPU ones)
        blob = b"".join(list(heads)[:self.max_hashes])
        self.last_hashes = min(len(heads), self.max_hashes)
        self.last_build_us = round((time.perf_counter() - started) * 1e6, 1)
        return blob

    def heartbeat_fields(self) -> dict[str, object]:
        """What the gateway needs to hash prompts alike, and what the last summary cost."""
        return {"block_size": self.scheduler.config.block_size, "prefix_summary_depth": SUMMARY_DEPTH_BLOCKS,
                "prefix_summary_hashes": self.last_hashes, "prefix_summary_gpu_hashes": self.last_gpu_hashes,
                "prefix_summary_bytes": self.last_hashes * SUMMARY_HASH_BYTES,
                "prefix_summary_build_us": self.last_build_us}
