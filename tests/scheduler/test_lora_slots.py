"""The engine's adapter slots (scheduler/lora_slots.py): running requests keep their adapter's
slot, others are swapped in least recently used first, and the KV block chain knows adapters."""

from __future__ import annotations

import pytest

from scheduler.block_manager import update_block_hashes
from scheduler.lora_slots import LoraSlots
from scheduler.request import Request
from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams
from shared.step import LoraLoad


def test_adapters_take_free_slots_then_the_least_recently_used_idle_one() -> None:
    slots = LoraSlots(max_loras=2)
    a, b, c = (slots.register(name, f"/adapters/{name}", 8) for name in "abc")
    assert slots.slot_for(None) == 0  # the base needs no slot
    assert (slots.slot_for(a), slots.slot_for(b), slots.slot_for(a)) == (1, 2, 1)
    assert slots.take_loads() == [LoraLoad(1, a.adapter_id, "a", "/adapters/a"),
                                  LoraLoad(2, b.adapter_id, "b", "/adapters/b")]
    assert slots.take_loads() == []  # asked once
    slots.count_running([])
    assert slots.slot_for(c) == 2  # b was used longest ago
    assert slots.take_loads() == [LoraLoad(2, c.adapter_id, "c", "/adapters/c")]
    assert slots.loaded_names() == ["a", "c"]


def test_running_requests_keep_their_adapters_slots() -> None:
    slots = LoraSlots(max_loras=2)
    a, b, c = (slots.register(name, f"/adapters/{name}", 8) for name in "abc")
    slots.slot_for(a)
    slots.slot_for(b)
    slots.count_running([a, b, b])
    assert not slots.can_run(c)  # both slots serve running requests
    assert slots.can_run(a) and slots.can_run(None)
    slots.count_running([b])
    assert slots.can_run(c)
    assert slots.slot_for(c) == 1  # a's slot: b's is in use
    slots.started(c)
    assert not slots.can_run(a)


def test_a_name_loaded_again_is_another_adapter() -> None:
    slots = LoraSlots(max_loras=1)
    first = slots.register("sql", "/v1", 8)
    with pytest.raises(InvalidRequestError, match="loaded already"):
        slots.register("sql", "/v2", 8)
    slots.unregister("sql")
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'sql' is served here"):
        slots.get("sql")
    second = slots.register("sql", "/v2", 8)
    assert second.adapter_id != first.adapter_id and second.cache_key != first.cache_key


def test_block_hashes_differ_by_adapter_and_agree_within_one() -> None:
    slots = LoraSlots(max_loras=2)
    a, b = slots.register("a", "/a", 4), slots.register("b", "/b", 4)
    tokens = list(range(40))

    def hashes(adapter):
        request = Request("r", tokens, SamplingParams())
        request.lora = adapter
        return update_block_hashes(request, 16)

    assert hashes(a) == hashes(a)
    assert len({hashes(None)[0], hashes(a)[0], hashes(b)[0]}) == 3
    assert not set(hashes(a)) & set(hashes(b))
