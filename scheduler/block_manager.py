"""Hands out fixed-size KV cache blocks to requests, and keeps full blocks for reuse.

Automatic prefix caching: a full block is addressed by a hash that chains its parent
block's hash with its own token ids, so equal hashes mean equal tokens at equal positions
from the start of the sequence, hence equal K/V. Blocks carry reference counts; a block
nobody holds stays in the cache, free to be taken back by the next request with the same
prefix, until a new block is needed and none is left that holds nothing: then the least
recently used cached one is evicted. Only full blocks are shared; a request's last partial
block (where it writes) is its own.

A copy between the GPU and the host tier (scheduler/host_tier.py) holds the blocks it reads or
writes like a request does (`hold` / `release`): a block whose store has not read it yet, or
whose load has not written it yet, is never handed out again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import islice

from protocol.prefix_hash import BlockHash, adapter_root, extend_block_hashes, rope_root
from scheduler.request import Request

# The first blocks of each cached chain are remembered apart, most recently used last, so that
# the scheduler's prefix summary (service/prefix_summary.py) costs O(its size), not O(cache).
SUMMARY_DEPTH_BLOCKS = 64


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def update_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """The hashes of every full block of the request's tokens, extended in place (the tokens
    of a request only ever grow, so earlier hashes never change). The chain is protocol/prefix_hash's,
    the one the gateway routes by."""
    hashes = request.block_hashes
    starts = range(len(hashes) * block_size, request.num_tokens // block_size * block_size, block_size)
    root = rope_root(request.rope_offset)
    if request.lora is not None:  # an adapter's K/V is its own: two adapters never share a block
        root = adapter_root(root, request.lora.cache_key)
    return extend_block_hashes(hashes, (request.token_ids_slice(s, s + block_size) for s in starts), root)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Popped from the end: reversed so blocks are handed out 0, 1, 2... on a fresh cache,
        # which keeps block tables easy to read in logs and tests. Blocks here hold nothing.
        self._empty_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks that still hold a cached prefix, least recently used first: evicted
        # from the front only when no empty block is left.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._ref_counts = [0] * num_blocks  # block id -> requests holding it
        self._hash_of_block: dict[int, BlockHash] = {}  # block id -> its hash, for cached blocks
        self._block_of_hash: dict[BlockHash, int] = {}  # hash -> the block holding it
        # Cached hashes within the first SUMMARY_DEPTH_BLOCKS of their chain, least recently
        # used first (a chain's head after its later blocks, so a cut summary keeps heads).
        self._head_hashes: OrderedDict[BlockHash, None] = OrderedDict()
        # As vLLM counts them, in tokens: prompt tokens looked up on first admission, and
        # how many of them were found in the cache.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # With a host tier: (hash, block id, its index in its chain) of each block registered since
        # the tier last took them (scheduler/host_tier.py copies them to the host); None: nobody asks.
        self.newly_registered: list[tuple[BlockHash, int, int]] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they can be taken at any time)."""
        return len(self._empty_block_ids) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of_hash)

    def recent_head_hashes(self, limit: int) -> list[BlockHash]:
        """Up to `limit` cached hashes of the first SUMMARY_DEPTH_BLOCKS blocks of their chains,
        most recently used first: what the scheduler tells the gateways it holds."""
        return list(islice(reversed(self._head_hashes), limit))

    def _touch_heads(self, hashes: Sequence[BlockHash]) -> None:
        for block_hash in reversed(hashes[:SUMMARY_DEPTH_BLOCKS]):  # block 0 ends up the most recent
            if block_hash in self._block_of_hash:
                self._head_hashes[block_hash] = None
                self._head_hashes.move_to_end(block_hash)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    # -- lookup ----------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of the request's tokens (nothing changes).

        At most (num_tokens - 1) // block_size blocks: the last token is always computed,
        so that the step that admits the request has logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = update_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids = []
        for block_hash in hashes[:max_blocks]:
            block_id = self._block_of_hash.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    # -- allocation ------------------------------------------------------------------

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_cached_blocks: int = 0) -> int:
        """Blocks to add so that num_computed_tokens + num_new_tokens slots are covered (after
        taking num_cached_blocks cached blocks, for a request that holds none yet)."""
        num_slots = request.num_computed_tokens + num_cached_blocks * self.block_size + num_new_tokens
        return max(0, cdiv(num_slots, self.block_size) - len(request.block_ids) - num_cached_blocks)

    def num_free_blocks_taken(self, request: Request, num_new_tokens: int,
                              cached_block_ids: Sequence[int] = ()) -> int:
        """What allocate_slots would take out of the free blocks: the new ones, and the cached
        hits that nobody holds now."""
        num_idle_hits = sum(1 for b in cached_block_ids if self._ref_counts[b] == 0)
        return self.num_blocks_needed(request, num_new_tokens, len(cached_block_ids)) + num_idle_hits

    def num_blocks_freed_by(self, request: Request, keep: Sequence[int] = ()) -> int:
        """Free blocks that freeing the request would add, not counting those in `keep` (a
        newcomer's cached hits, which it would take straight back)."""
        return sum(1 for b in request.block_ids if self._ref_counts[b] == 1 and b not in keep)

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_free_blocks_taken(request, num_new_tokens) <= self.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_block_ids: Sequence[int] = ()) -> bool:
        """Grow request.block_ids to cover the new tokens; False (and no change) when short.

        cached_block_ids (from find_cached_prefix, for a request holding no blocks) become the
        start of its block table, and its num_computed_tokens moves past them.
        """
        if self.num_free_blocks_taken(request, num_new_tokens, cached_block_ids) > self.num_free_blocks:
            return False
        if cached_block_ids:
            if request.block_ids or request.num_computed_tokens:
                raise ValueError(f"{request.req_id}: cached blocks are for a request with none yet")
            for block_id in cached_block_ids:
                self._take(block_id)
            self._touch_heads([self._hash_of_block[b] for b in cached_block_ids[:SUMMARY_DEPTH_BLOCKS]])
            request.block_ids = list(cached_block_ids)
            request.num_computed_tokens = len(cached_block_ids) * self.block_size
            request.num_registered_blocks = len(cached_block_ids)
        for _ in range(self.num_blocks_needed(request, num_new_tokens)):
            request.block_ids.append(self._take_empty())
        return True

    def record_first_admission(self, request: Request, num_host_tokens: int = 0) -> None:
        """Count the request in prefix_cache_queries / _hits (once: a preempted request that
        comes back is not counted again) and remember its hit for its usage, which counts the
        `num_host_tokens` loaded from the host tier too (they are not hits of this cache)."""
        if request.num_cached_tokens is not None:
            return
        request.num_cached_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_prompt_tokens
            self.prefix_cache_hits += max(0, request.num_cached_tokens - num_host_tokens)

    def hold(self, block_ids: Sequence[int]) -> None:
        """One more holder of each block (a copy in flight): not handed out before `release`."""
        for block_id in block_ids:
            self._take(block_id)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop a `hold`; a block nobody holds any more is free (cached if it has a hash)."""
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if block_id in self._hash_of_block:
                    self._free_cached[block_id] = None
                else:
                    self._empty_block_ids.append(block_id)

    def block_of(self, block_hash: BlockHash) -> int | None:
        """The block holding `block_hash` in this cache, if any."""
        return self._block_of_hash.get(block_hash)

    def _take(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._free_cached[block_id]
        self._ref_counts[block_id] += 1

    def _take_empty(self) -> int:
        if self._empty_block_ids:
            block_id = self._empty_block_ids.pop()
        else:  # evict the least recently used cached block
            block_id, _ = self._free_cached.popitem(last=False)
            block_hash = self._hash_of_block.pop(block_id)
            del self._block_of_hash[block_hash]
            self._head_hashes.pop(block_hash, None)
        self._ref_counts[block_id] = 1
        return block_id

    # -- caching and freeing ---------------------------------------------------------

    def register_full_blocks(self, request: Request) -> None:
        """Make the request's blocks whose tokens are all computed findable by hash (called
        once their K/V is in the cache, so no other request reads a block still being written)."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_registered_blocks:
            return
        hashes = update_block_hashes(request, self.block_size)
        for index in range(request.num_registered_blocks, num_full):
            block_id, block_hash = request.block_ids[index], hashes[index]
            # The same tokens computed twice (two requests admitted before either's blocks were
            # registered): the first block keeps the hash, this one stays private.
            if block_hash not in self._block_of_hash and block_id not in self._hash_of_block:
                self._block_of_hash[block_hash] = block_id
                self._hash_of_block[block_id] = block_hash
                if self.newly_registered is not None:
                    self.newly_registered.append((block_hash, block_id, index))
        if request.num_registered_blocks < SUMMARY_DEPTH_BLOCKS:
            self._touch_heads(hashes[:num_full])
        request.num_registered_blocks = num_full

    def free(self, request: Request) -> None:
        """Let go of the request's blocks; its block table becomes empty. A block nobody else
        holds keeps its cached prefix, if it has one, until it is evicted."""
        # Reversed: the tail of a sequence is evicted before its head, which more requests
        # share, and an empty block freed first is handed out again first.
        self.release(request.block_ids[::-1])
        request.block_ids = []
        request.num_registered_blocks = 0

    def free_tail(self, request: Request, num_slots: int) -> None:
        """Give back the request's blocks past its first `num_slots` slots (speculative decoding's
        rejected drafts). Such blocks hold no computed token, so none is registered or shared."""
        keep = cdiv(num_slots, self.block_size)
        if keep < request.num_registered_blocks:
            raise ValueError(f"{request.req_id}: would free registered blocks")
        while len(request.block_ids) > keep:
            block_id = request.block_ids.pop()
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._empty_block_ids.append(block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the K/V behind them is gone: a worker group was rebuilt).
        Blocks that requests still hold stay theirs, but can no longer be found by hash."""
        for block_id in self._free_cached:
            self._empty_block_ids.append(block_id)
        self._free_cached.clear()
        self._block_of_hash.clear()
        self._hash_of_block.clear()
        self._head_hashes.clear()
        if self.newly_registered is not None:
            self.newly_registered.clear()
