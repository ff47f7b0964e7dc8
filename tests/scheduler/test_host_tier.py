"""scheduler/host_tier.py's slot rule, alone: a host slot that a load in flight reads is never
taken for a store (the store would overwrite the bytes the load is copying to the GPU)."""

from __future__ import annotations

from scheduler.host_tier import HostTier


class GpuHolds:
    """The GPU side of a load, as far as the tier's slots are concerned: which blocks it holds."""

    def __init__(self) -> None:
        self.held: list[int] = []

    def hold(self, block_ids) -> None:
        self.held += block_ids


def test_a_slot_being_loaded_from_is_never_taken_for_a_store() -> None:
    tier = HostTier(num_blocks=2, block_bytes=1)
    blocks = GpuHolds()
    # Two held blocks fill the tier; "a" is the least recently used, the first to be replaced.
    tier._slot_of_hash.update({b"a": tier._take_slot(), b"b": tier._take_slot()})
    [slot_a] = tier.match([b"a"])
    tier.match([b"b"])  # "b" used since: "a" is the least recently used again
    tier.load([slot_a], [0], blocks)  # a load reads "a"'s slot with the next step
    assert blocks.held == [0]
    assert tier._take_slot() != slot_a  # the store takes "b"'s slot instead
    # "b"'s slot now receives that store (held by no hash until it is back): a second store finds
    # only the slot being loaded from, and its block stays GPU-only.
    assert tier._take_slot() is None
    assert tier.match([b"a"]) == [slot_a]  # what the load reads is still there
