"""The chained hash of a KV block: the one function the block manager caches by and the gateway
routes by, so that a prompt hashed at the gateway names exactly the blocks a scheduler holds.

A full block's hash is sha256(parent block's hash + its token ids as int64), starting from a
fixed root: equal hashes mean equal tokens at equal positions from the start of the sequence,
hence equal K/V (sha256, not Python's unkeyed hash(): a crafted prompt must not collide with
another user's prefix and read its K/V). Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence

BlockHash = bytes

# The root of every chain. A model or weights change would change the K/V of every block, but
# one scheduler serves one model and its cache dies with it; anything that someday changes a
# block's K/V within one cache (LoRA adapters, multimodal inputs) must be hashed in here too.
ROOT_HASH: BlockHash = hashlib.sha256(b"tokenfleet-kv-block").digest()

# A scheduler's published summary keeps this many leading bytes of each hash: a routing hint
# only (a false match misroutes one request, it never shares K/V), 4x smaller than the digest.
SUMMARY_HASH_BYTES = 8

# A block a replica holds in its host KV tier counts this much of a block in its GPU cache when the
# gateway weighs where a prompt's prefix is held: loading it back is cheaper than recomputing it,
# dearer than finding it on the GPU. A summary lists its GPU hashes first, then its host ones.
HOST_TIER_WEIGHT = 0.5


def rope_root(rope_offset: int) -> BlockHash:
    """The root of the chains of sequences whose rotary table is another (rope_offset != 0:
    Qwen's dynamic NTK past its training context): the same tokens give other K/V there."""
    if not rope_offset:
        return ROOT_HASH
    return hashlib.sha256(ROOT_HASH + b"rope" + array("q", [rope_offset]).tobytes()).digest()


def adapter_root(root: BlockHash, adapter_key: str) -> BlockHash:
    """The root of the chains of sequences run with a LoRA adapter (its key names one
    registration of it): other weights give other K/V for the same tokens."""
    return hashlib.sha256(root + b"lora" + adapter_key.encode()).digest()


def hash_block(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def extend_block_hashes(hashes: list[BlockHash], blocks: Iterable[Sequence[int]],
                        root: BlockHash = ROOT_HASH) -> list[BlockHash]:
    """Append the hash of each block (the token ids of the blocks after those already hashed,
    in order), chained after the last hash in `hashes` (or `root`); returns `hashes`."""
    parent = hashes[-1] if hashes else root
    for token_ids in blocks:
        parent = hash_block(parent, token_ids)
        hashes.append(parent)
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[BlockHash]:
    """The hashes of the first full blocks of `token_ids` (at most `max_blocks` of them)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    starts = range(0, num_blocks * block_size, block_size)
    return extend_block_hashes([], (token_ids[s:s + block_size] for s in starts))


def summary_hash(block_hash: BlockHash) -> bytes:
    """A block hash as a scheduler's prefix summary carries it."""
    return block_hash[:SUMMARY_HASH_BYTES]
