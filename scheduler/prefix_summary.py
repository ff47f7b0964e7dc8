"""What a scheduler tells the gateways its KV cache holds, at each heartbeat.

`tf:prefixes:{id}` (with the heartbeat's TTL) is the concatenated first SUMMARY_HASH_BYTES of
the hashes of the cached blocks within the first SUMMARY_DEPTH_BLOCKS of their chains, the
most recently used first, at most `max_hashes` of them. The gateway hashes a prompt's first
blocks with the same function (shared/prefix_hash.py) and counts how many leading ones a
replica's summary names (gateway/routing.py). Its cost per heartbeat is bounded by
`max_hashes`, not by the cache's size (the block manager keeps the heads in LRU order), and
measured: the heartbeat carries the summary's size and the time it took to build.
"""

from __future__ import annotations

import time

from scheduler.block_manager import SUMMARY_DEPTH_BLOCKS
from scheduler.scheduler import Scheduler
from shared.prefix_hash import SUMMARY_HASH_BYTES

# 4,096 hashes of 8 bytes: 32 KiB a heartbeat at most; 64 chains of 64 blocks, or more shorter ones.
SUMMARY_MAX_HASHES = 4096


class PrefixSummary:
    def __init__(self, scheduler: Scheduler, max_hashes: int = SUMMARY_MAX_HASHES) -> None:
        self.scheduler = scheduler
        self.max_hashes = max_hashes
        self.last_hashes = 0
        self.last_build_us = 0.0

    def build(self) -> bytes:
        started = time.perf_counter()
        heads = self.scheduler.block_manager.recent_head_hashes(self.max_hashes)
        blob = b"".join(h[:SUMMARY_HASH_BYTES] for h in heads)
        self.last_hashes = len(heads)
        self.last_build_us = round((time.perf_counter() - started) * 1e6, 1)
        return blob

    def heartbeat_fields(self) -> dict[str, object]:
        """What the gateway needs to hash prompts alike, and what the last summary cost."""
        return {"block_size": self.scheduler.config.block_size, "prefix_summary_depth": SUMMARY_DEPTH_BLOCKS,
                "prefix_summary_hashes": self.last_hashes,
                "prefix_summary_bytes": self.last_hashes * SUMMARY_HASH_BYTES,
                "prefix_summary_build_us": self.last_build_us}
