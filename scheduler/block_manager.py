"""Hands out fixed-size KV cache blocks to requests from one free list (no prefix caching)."""

from __future__ import annotations

from scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Popped from the end: reversed so blocks are handed out 0, 1, 2... on a fresh cache,
        # which keeps block tables easy to read in logs and tests.
        self._free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - len(self._free_block_ids) / self.num_blocks

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so that num_computed_tokens + num_new_tokens slots are covered."""
        num_slots = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(num_slots, self.block_size) - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(request, num_new_tokens) <= len(self._free_block_ids)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow request.block_ids to cover the new tokens; False (and no change) when short."""
        num_needed = self.num_blocks_needed(request, num_new_tokens)
        if num_needed > len(self._free_block_ids):
            return False
        for _ in range(num_needed):
            request.block_ids.append(self._free_block_ids.pop())
        return True

    def free(self, request: Request) -> None:
        """Return all of the request's blocks; its block table becomes empty."""
        # Reversed so the request's first block is the next one handed out again.
        self._free_block_ids.extend(reversed(request.block_ids))
        request.block_ids = []
