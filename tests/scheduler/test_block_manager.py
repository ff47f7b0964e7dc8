from __future__ import annotations

import pytest

from scheduler.block_manager import BlockManager
from scheduler.request import Request
from shared.sampling import SamplingParams


def make_request(num_prompt_tokens: int = 10, req_id: str = "r") -> Request:
    return Request(req_id, list(range(num_prompt_tokens)), SamplingParams())


def test_allocate_covers_computed_plus_new_tokens_rounded_up_to_blocks() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request()
    assert manager.allocate_slots(request, 5)
    assert len(request.block_ids) == 2
    request.num_computed_tokens = 5
    assert manager.allocate_slots(request, 3)  # 8 slots: still 2 blocks
    assert len(request.block_ids) == 2
    assert manager.allocate_slots(request, 4)  # 9 slots: a third block
    assert len(request.block_ids) == 3
    assert manager.num_free_blocks == 5


def test_block_zero_is_a_normal_block_and_ids_are_unique() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    first, second = make_request(req_id="a"), make_request(req_id="b")
    assert manager.allocate_slots(first, 4)
    assert manager.allocate_slots(second, 4)
    assert sorted(first.block_ids + second.block_ids) == [0, 1, 2, 3]


def test_allocate_when_short_returns_false_and_changes_nothing() -> None:
    manager = BlockManager(num_blocks=3, block_size=4)
    holder, request = make_request(req_id="holder"), make_request(req_id="r")
    assert manager.allocate_slots(holder, 8)
    assert manager.allocate_slots(request, 4)
    request.num_computed_tokens = 4
    assert not manager.can_allocate(request, 5)
    assert not manager.allocate_slots(request, 5)
    assert len(request.block_ids) == 1
    assert manager.num_free_blocks == 0


def test_can_allocate_agrees_with_allocate_slots() -> None:
    manager = BlockManager(num_blocks=2, block_size=4)
    request = make_request()
    assert manager.can_allocate(request, 8)
    assert not manager.can_allocate(request, 9)
    assert not manager.allocate_slots(request, 9)
    assert manager.allocate_slots(request, 8)


def test_free_returns_blocks_and_empties_block_table() -> None:
    manager = BlockManager(num_blocks=4, block_size=4)
    request = make_request()
    manager.allocate_slots(request, 16)
    assert manager.num_free_blocks == 0
    manager.free(request)
    assert request.block_ids == []
    assert manager.num_free_blocks == 4
    other = make_request(req_id="other")
    assert manager.allocate_slots(other, 16)


def test_usage_is_the_fraction_of_blocks_held() -> None:
    manager = BlockManager(num_blocks=4, block_size=4)
    assert manager.usage == 0.0
    request = make_request()
    manager.allocate_slots(request, 5)
    assert manager.usage == pytest.approx(0.5)
    manager.free(request)
    assert manager.usage == 0.0


def test_zero_sized_cache_is_rejected() -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=16)


# -- prefix caching -------------------------------------------------------------------


def computed(manager: BlockManager, request: Request, num_tokens: int) -> Request:
    """Allocate and mark num_tokens as computed, as a step would; registers its full blocks."""
    assert manager.allocate_slots(request, num_tokens - request.num_computed_tokens)
    request.num_computed_tokens = num_tokens
    manager.register_full_blocks(request)
    return request


def with_tokens(token_ids: list[int], req_id: str) -> Request:
    return Request(req_id, list(token_ids), SamplingParams())


def test_block_hashes_chain_the_parent_so_equal_blocks_after_different_prefixes_differ() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    a = with_tokens([1, 2, 3, 4, 9, 9, 9, 9, 0], "a")
    b = with_tokens([5, 6, 7, 8, 9, 9, 9, 9, 0], "b")
    computed(manager, a, 9)
    assert manager.num_cached_blocks == 2  # the partial third block is not cached
    assert manager.find_cached_prefix(b) == []
    assert a.block_hashes[1] != b.block_hashes[1]  # the same tokens after another parent
    same = with_tokens([1, 2, 3, 4, 9, 9, 9, 9, 7, 7], "same")
    assert manager.find_cached_prefix(same) == a.block_ids[:2]
    changed_second_block = with_tokens([1, 2, 3, 4, 9, 9, 9, 8, 7, 7], "changed")
    assert manager.find_cached_prefix(changed_second_block) == a.block_ids[:1]


def test_a_hit_takes_shared_blocks_by_reference_and_starts_after_them() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    first = computed(manager, with_tokens(list(range(10)), "first"), 10)
    second = with_tokens(list(range(8)) + [50, 51, 52], "second")
    hits = manager.find_cached_prefix(second)
    assert hits == first.block_ids[:2]
    assert manager.allocate_slots(second, 3, hits)
    manager.record_first_admission(second)
    assert second.num_computed_tokens == 8 and second.block_ids[:2] == hits
    assert second.block_ids[2] not in first.block_ids  # the last partial block is its own
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (11, 8)
    assert second.num_cached_tokens == 8
    manager.free(first)
    # Still held by `second`: not free, and first's private partial block is.
    assert manager.num_free_blocks == 8 - 3
    manager.free(second)
    assert manager.num_free_blocks == 8 and manager.num_cached_blocks == 2


def test_a_full_prompt_hit_leaves_the_last_token_to_compute() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    computed(manager, with_tokens(list(range(12)), "first"), 12)
    assert manager.num_cached_blocks == 3
    again = with_tokens(list(range(12)), "again")
    assert len(manager.find_cached_prefix(again)) == 2  # (12 - 1) // 4: token 11 is recomputed
    longer = with_tokens(list(range(13)), "longer")
    assert len(manager.find_cached_prefix(longer)) == 3


def test_free_cached_blocks_are_evicted_least_recently_used_and_only_when_no_empty_block_is_left() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    old = computed(manager, with_tokens([1, 1, 2, 2], "old"), 4)
    new = computed(manager, with_tokens([3, 3, 4, 4], "new"), 4)
    manager.free(old)
    manager.free(new)
    assert manager.num_free_blocks == 4 and manager.num_cached_blocks == 4
    # Reuse old's prefix: it becomes the most recently used.
    reuse = with_tokens([1, 1, 2, 2, 5], "reuse")
    hits = manager.find_cached_prefix(reuse)
    assert len(hits) == 2 and manager.allocate_slots(reuse, 1, hits)
    manager.free(reuse)
    # One new block is needed by a stranger: it evicts new's tail block first (a sequence's
    # tail goes before its head), and old's prefix survives.
    stranger = computed(manager, with_tokens([8, 8], "stranger"), 2)
    assert manager.num_cached_blocks == 4  # 3 old ones + its own
    assert len(manager.find_cached_prefix(with_tokens([1, 1, 2, 2, 0], "x"))) == 2
    assert len(manager.find_cached_prefix(with_tokens([3, 3, 4, 4, 0], "y"))) == 1
    manager.free(stranger)


def test_capacity_counts_idle_cached_hits_as_taken_from_the_free_blocks() -> None:
    manager = BlockManager(num_blocks=3, block_size=2)
    manager.free(computed(manager, with_tokens([1, 2, 3, 4], "a"), 4))
    request = with_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9], "b")
    hits = manager.find_cached_prefix(request)
    assert len(hits) == 2
    # 2 hits + 3 new blocks for tokens 4..8 > 3 blocks: refused, nothing changes.
    assert not manager.allocate_slots(request, 5, hits)
    assert request.block_ids == [] and manager.num_free_blocks == 3
    assert manager.allocate_slots(request, 2, hits)
    assert manager.num_free_blocks == 0


def test_the_same_block_computed_twice_stays_private_the_second_time() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    a = computed(manager, with_tokens([1, 2, 3], "a"), 3)
    b = computed(manager, with_tokens([1, 2, 3], "b"), 3)  # admitted without looking up
    assert manager.num_cached_blocks == 1
    manager.free(b)
    assert manager.num_free_blocks == 2  # b's copy went back empty, not cached
    manager.free(a)


def test_reset_forgets_every_cached_prefix() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    manager.free(computed(manager, with_tokens([1, 2, 3], "a"), 3))
    manager.reset_prefix_cache()
    assert manager.num_cached_blocks == 0 and manager.num_free_blocks == 4
    assert manager.find_cached_prefix(with_tokens([1, 2, 3], "b")) == []


def test_disabled_caching_finds_nothing_and_counts_nothing() -> None:
    manager = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    manager.free(computed(manager, with_tokens([1, 2, 3], "a"), 3))
    request = with_tokens([1, 2, 3], "b")
    assert manager.find_cached_prefix(request) == []
    manager.record_first_admission(request)
    assert manager.num_cached_blocks == 0
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)
