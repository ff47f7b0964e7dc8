"""Which adapters an engine serves, and which of them sit in the runners' `max_loras` slots.

Pure Python, no I/O. The scheduler admits a request on an adapter only while the adapters of
the running requests leave a slot for it (`can_run`), so a step never needs more than
`max_loras`. Building a step, each work gets its adapter's slot (`slot_for`): an adapter in
a slot stays there; one that is not takes a free slot or the least recently used one no
running request needs, and the step carries the load (`take_loads`) for every rank to do.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass

from shared.errors import InvalidRequestError
from shared.step import LoraLoad


@dataclass(frozen=True)
class RegisteredLora:
    name: str
    adapter_id: int  # unique per registration: the same name loaded again is another adapter
    path: str
    rank: int

    @property
    def cache_key(self) -> str:
        """What the KV block hash chain starts from for this adapter (protocol/prefix_hash.py)."""
        return f"{self.name}#{self.adapter_id}"


class LoraSlots:
    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self.adapters: dict[str, RegisteredLora] = {}  # name -> the adapter served under it
        self._ids = itertools.count(1)
        # adapter id -> its slot, least recently used first
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        self._free_slots = list(range(max_loras, 0, -1))  # popped from the end: 1 first
        self._running = Counter()  # adapter id -> running requests on it
        self._loads: list[LoraLoad] = []  # for the next step
        self.num_loads = 0  # slot loads asked of the runners so far
        self.num_requests: Counter[str] = Counter()  # adapter name -> requests added on it

    # -- the adapters served -------------------------------------------------------

    def register(self, name: str, path: str, rank: int) -> RegisteredLora:
        if name in self.adapters:
            raise InvalidRequestError(f"a LoRA adapter named {name!r} is loaded already", param="lora_name")
        adapter = RegisteredLora(name, next(self._ids), path, rank)
        self.adapters[name] = adapter
        return adapter

    def unregister(self, name: str) -> RegisteredLora:
        """Serve it no more (requests on it that run keep it until they end)."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded", param="lora_name")
        return adapter

    def get(self, name: str) -> RegisteredLora:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is served here", param="model")
        return adapter

    # -- running requests hold their adapter's slot --------------------------------------

    def can_run(self, adapter: RegisteredLora | None) -> bool:
        """Whether a request on `adapter` may start now: the running ones leave a slot for it."""
        return adapter is None or adapter.adapter_id in self._running or len(self._running) < self.max_loras

    def count_running(self, adapters: list[RegisteredLora]) -> None:
        """The adapters of the running requests (one entry per request), at the start of a
        schedule(); admissions add theirs with `started`."""
        self._running = Counter(a.adapter_id for a in adapters)

    def started(self, adapter: RegisteredLora | None) -> None:
        if adapter is not None:
            self._running[adapter.adapter_id] += 1

    # -- slots of a step -----------------------------------------------------------

    def slot_for(self, adapter: RegisteredLora | None) -> int:
        if adapter is None:
            return 0
        slot = self._slot_of.get(adapter.adapter_id)
        if slot is not None:
            self._slot_of.move_to_end(adapter.adapter_id)
            return slot
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((a for a in self._slot_of if a not in self._running), None)
            if victim is None:  # can_run keeps this from happening
                raise RuntimeError("every LoRA slot holds an adapter that running requests need")
            slot = self._slot_of.pop(victim)
        self._slot_of[adapter.adapter_id] = slot
        self._loads.append(LoraLoad(slot, adapter.adapter_id, adapter.name, adapter.path))
        self.num_loads += 1
        return slot

    def take_loads(self) -> list[LoraLoad]:
        loads, self._loads = self._loads, []
        return loads

    def loaded_names(self) -> list[str]:
        """The served adapters that sit in a slot now."""
        in_slots = set(self._slot_of)
        return sorted(a.name for a in self.adapters.values() if a.adapter_id in in_slots)

    def forget_slots(self) -> None:
        """The runners were rebuilt (a failed group): their slots are empty."""
        self._free_slots = list(range(self.max_loras, 0, -1))
        self._slot_of.clear()
        self._loads.clear()
