"""The host tier's index, kept by the scheduler: which full KV blocks the ranks' host pools hold
(workers/host_kv_pool.py), by the prefix cache's block hash, and the copies each step carries.

A block is copied to the host once it is full and registered in the prefix cache (as it fills,
not when it is evicted: docs/kv-offloading.md says why), unless the tier holds its hash already.
When the tier is full, the least recently used block it holds is overwritten. A request admitted
with a prefix beyond what the GPU cache holds takes the rest from here: its blocks are loaded
into new GPU blocks by the step that carries the loads, and it runs once that step is back.

Every copy goes with a StepBatch (`StepBatch.kv_stores` / `kv_loads`). Once that step has been
taken back, every rank orders its copies before any later step's kernels (on the device: the
runners do not wait for them before they answer; workers/host_kv_pool.py), so a step scheduled
from then on never sees them unfinished. Until then the GPU blocks a copy reads or writes are
held in the block manager (a store's block is never handed out before the store has read it; a
load's block never before it is written), and the host slots a load reads are pinned (never
overwritten by a store meanwhile); a store's slot is findable only once its step is back.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from protocol.prefix_hash import BlockHash
from scheduler.block_manager import SUMMARY_DEPTH_BLOCKS, BlockManager


@dataclass
class _StepCopies:
    """The copies one step carries."""

    # (hash, GPU block, slot, whether it is among its chain's first SUMMARY_DEPTH_BLOCKS)
    stores: list[tuple[BlockHash, int, int, bool]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (slot, GPU block)


@dataclass
class HostTierCounters:
    """Totals since the engine started (scheduler/engine_metrics.py exports them)."""

    num_hit_tokens: int = 0  # prompt tokens that admissions took from the host tier
    num_stored_blocks: int = 0
    num_loaded_blocks: int = 0
    num_stored_bytes: int = 0  # over every rank of the replica
    num_loaded_bytes: int = 0
    load_seconds: float = 0.0  # the driver rank's time spent in its loads' copies


class HostTier:
    def __init__(self, num_blocks: int, block_bytes: int) -> None:
        """`block_bytes`: one block's bytes over every rank of the replica."""
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self._slot_of_hash: OrderedDict[BlockHash, int] = OrderedDict()  # readable, least recent first
        self._free_slots: list[int] = list(range(num_blocks - 1, -1, -1))
        self._pinned: Counter[int] = Counter()  # slot -> loads in flight reading it
        self._storing: set[BlockHash] = set()  # hashes whose store is in flight
        # Held hashes within the first SUMMARY_DEPTH_BLOCKS of their chain, least recently used
        # first: what the prefix summary names (service/prefix_summary.py).
        self._heads: OrderedDict[BlockHash, None] = OrderedDict()
        self._next = _StepCopies()  # the copies the next batch carries
        self._in_flight: dict[int, _StepCopies] = {}  # step id -> its copies
        self.counters = HostTierCounters()

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_slots)

    @property
    def usage(self) -> float:
        """Fraction of the host blocks holding (or receiving) a block, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def recent_head_hashes(self, limit: int) -> list[BlockHash]:
        """Up to `limit` held hashes of the first SUMMARY_DEPTH_BLOCKS blocks of their chains,
        most recently used first (the prefix summary)."""
        hashes = []
        for block_hash in reversed(self._heads):
            if len(hashes) >= limit:
                break
            hashes.append(block_hash)
        return hashes

    # -- loads --------------------------------------------------------------------------

    def match(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The slots holding the longest run of `hashes` from its start (most recently used now)."""
        slots = []
        for block_hash in hashes:
            slot = self._slot_of_hash.get(block_hash)
            if slot is None:
                break
            self._slot_of_hash.move_to_end(block_hash)
            if block_hash in self._heads:
                self._heads.move_to_end(block_hash)
            slots.append(slot)
        return slots

    def load(self, slots: Sequence[int], block_ids: Sequence[int], blocks: BlockManager) -> None:
        """Copy `slots` into the GPU blocks `block_ids` with the next batch; both stay theirs
        (pinned, held) until that step is back."""
        if len(slots) != len(block_ids):
            raise ValueError(f"{len(slots)} host blocks for {len(block_ids)} GPU blocks")
        self._pinned.update(slots)
        blocks.hold(block_ids)
        self._next.loads.extend(zip(slots, block_ids, strict=True))

    # -- stores -------------------------------------------------------------------------

    def plan_stores(self, blocks: BlockManager) -> None:
        """Copy the blocks the GPU cache registered since the last call to the host with the next
        batch, but those the tier holds or receives already; each GPU block held until then."""
        registered = blocks.newly_registered or []
        for block_hash, block_id, index in registered:
            if block_hash in self._slot_of_hash:
                self._slot_of_hash.move_to_end(block_hash)
                continue
            if block_hash in self._storing or blocks.block_of(block_hash) != block_id:
                continue  # stored already, or evicted from the GPU before its store went
            slot = self._take_slot()
            if slot is None:
                break  # every slot is being read or written: these blocks stay GPU-only
            blocks.hold([block_id])
            self._storing.add(block_hash)
            self._next.stores.append((block_hash, block_id, slot, index < SUMMARY_DEPTH_BLOCKS))
        registered.clear()

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, slot in self._slot_of_hash.items():  # least recently used first
            if not self._pinned[slot]:
                del self._slot_of_hash[block_hash]
                self._heads.pop(block_hash, None)
                return slot
        return None

    # -- with the steps -----------------------------------------------------------------

    def take_copies(self, step_id: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies for batch `step_id`: ([(GPU block, slot)] stores, [(slot, GPU block)] loads)."""
        copies, self._next = self._next, _StepCopies()
        if not copies.stores and not copies.loads:
            return [], []
        self._in_flight[step_id] = copies
        return [(block_id, slot) for _, block_id, slot, _ in copies.stores], list(copies.loads)

    def step_done(self, step_id: int, blocks: BlockManager, load_seconds: float = 0.0) -> None:
        """Step `step_id` is back, its copies ordered before every later step: stored blocks become
        findable, held GPU blocks and pinned slots are let go. `load_seconds`: the loads' time the
        step's result reports (of loads complete since the previous result, this step's or not)."""
        # (The time of loads done since the last step back: the runners never wait to time them.)
        self.counters.load_seconds += load_seconds
        copies = self._in_flight.pop(step_id, None)
        if copies is None:
            return
        for block_hash, block_id, slot, is_head in copies.stores:
            self._storing.discard(block_hash)
            self._slot_of_hash[block_hash] = slot
            if is_head:
                self._heads[block_hash] = None
            blocks.release([block_id])
        for slot, block_id in copies.loads:
            self._pinned[slot] -= 1
            if not self._pinned[slot]:
                del self._pinned[slot]
            blocks.release([block_id])
        counters = self.counters
        counters.num_stored_blocks += len(copies.stores)
        counters.num_loaded_blocks += len(copies.loads)
        counters.num_stored_bytes += len(copies.stores) * self.block_bytes
        counters.num_loaded_bytes += len(copies.loads) * self.block_bytes

    def reset(self, blocks: BlockManager) -> None:
        """The worker group died, its host pools with it: forget every block, let go of every
        GPU block a copy held (their requests were preempted)."""
        for copies in [*self._in_flight.values(), self._next]:
            blocks.release([block_id for _, block_id, _, _ in copies.stores])
            blocks.release([block_id for _, block_id in copies.loads])
        self._in_flight.clear()
        self._next = _StepCopies()
        self._slot_of_hash.clear()
        self._heads.clear()
        self._pinned.clear()
        self._storing.clear()
        self._free_slots = list(range(self.num_blocks - 1, -1, -1))
