"""The gateway hashes a prompt with protocol/prefix_hash.py; the block manager caches blocks under
update_block_hashes. They must agree on every block size a scheduler accepts, or routing by
prefix would send every chat to a replica that holds nothing of it."""

from __future__ import annotations

import random

import pytest

from protocol.prefix_hash import block_hashes, summary_hash
from scheduler.block_manager import SUMMARY_DEPTH_BLOCKS, BlockManager, update_block_hashes
from scheduler.request import Request
from scheduler.scheduler import SchedulerConfig
from shared.sampling import SamplingParams

BLOCK_SIZES = [*range(1, 65), 96, 128, 256, 512]  # a scheduler accepts any size >= 1


def _cached_hashes(manager: BlockManager, tokens: list[int]) -> list[bytes]:
    """Run `tokens` through the manager as a request that computed them all, then let go."""
    request = Request("r", tokens, SamplingParams())
    assert manager.allocate_slots(request, len(tokens))
    request.num_computed_tokens = len(tokens)
    manager.register_full_blocks(request)
    manager.free(request)
    return list(manager._block_of_hash)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_the_gateways_hash_is_the_block_managers(block_size: int) -> None:
    rng = random.Random(block_size)
    tokens = [rng.randrange(50_000) for _ in range(3 * block_size + rng.randrange(block_size))]
    manager = BlockManager(num_blocks=8, block_size=block_size)
    assert block_hashes(tokens, block_size) == _cached_hashes(manager, tokens)
    # A prompt that shares the first blocks finds them under the gateway's hashes too.
    follower = Request("f", tokens[:2 * block_size] + [7] * (block_size + 1), SamplingParams())
    assert len(manager.find_cached_prefix(follower)) == 2
    assert block_hashes(follower.prompt_token_ids, block_size)[:2] == block_hashes(tokens, block_size)[:2]
    # ...and the summary the scheduler publishes names them.
    summary = set(manager.recent_head_hashes(4096))
    assert {summary_hash(h) for h in block_hashes(tokens, block_size)} == {summary_hash(h) for h in summary}


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_hashes_agree_across_the_prompt_output_boundary(block_size: int) -> None:
    """A request's blocks mix prompt and output tokens; a follow-up turn's prompt is both."""
    request = Request("r", list(range(100, 100 + 2 * block_size + 1)), SamplingParams())
    request.output_token_ids = list(range(5, 5 + 2 * block_size))
    assert update_block_hashes(request, block_size) == block_hashes(request.all_token_ids, block_size)


def test_one_token_changed_changes_its_block_and_every_later_one() -> None:
    tokens = list(range(64))
    changed = [*tokens[:20], 999, *tokens[21:]]
    a, b = block_hashes(tokens, 16), block_hashes(changed, 16)
    assert a[0] == b[0] and all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def test_max_blocks_and_bad_block_sizes() -> None:
    assert len(block_hashes(list(range(100)), 4, max_blocks=3)) == 3
    assert block_hashes(list(range(15)), 16) == []
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2, 3], 0)
    with pytest.raises(ValueError, match="block_size"):
        SchedulerConfig(max_model_len=64, num_kv_blocks=8, block_size=0)


def test_summary_heads_are_bounded_in_depth_and_forget_evicted_blocks() -> None:
    manager = BlockManager(num_blocks=SUMMARY_DEPTH_BLOCKS + 8, block_size=1)
    tokens = list(range(SUMMARY_DEPTH_BLOCKS + 4))
    _cached_hashes(manager, tokens)
    heads = manager.recent_head_hashes(10_000)
    assert heads == block_hashes(tokens, 1)[:SUMMARY_DEPTH_BLOCKS]  # block 0 first: a cut keeps heads
    assert manager.recent_head_hashes(3) == heads[:3]
    _cached_hashes(manager, [9_999] * (SUMMARY_DEPTH_BLOCKS + 8))  # evicts every block of the first
    assert not set(heads) & set(manager.recent_head_hashes(10_000))
    manager.reset_prefix_cache()
    assert manager.recent_head_hashes(10) == []


def test_the_summary_names_what_admitted_requests_are_computing_before_it_is_cached() -> None:
    from types import SimpleNamespace

    from service.prefix_summary import PrefixSummary

    manager = BlockManager(num_blocks=64, block_size=4)
    cached = list(range(100, 112))
    _cached_hashes(manager, cached)
    summary = PrefixSummary(SimpleNamespace(block_manager=manager, config=SimpleNamespace(block_size=4),
                                            host_tier=None),
                            max_hashes=5)
    computing = Request("c", list(range(500, 513)), SamplingParams())  # admitted, nothing computed yet
    blob = summary.build([computing])
    names = [blob[i:i + 8] for i in range(0, len(blob), 8)]
    assert names == [summary_hash(h) for h in block_hashes(computing.prompt_token_ids, 4)] + \
        [summary_hash(block_hashes(cached, 4)[0]), summary_hash(block_hashes(cached, 4)[1])]
    assert summary.heartbeat_fields()["prefix_summary_hashes"] == 5
