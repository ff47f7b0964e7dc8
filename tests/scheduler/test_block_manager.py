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
