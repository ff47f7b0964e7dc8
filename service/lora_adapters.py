"""A scheduler's side of the fleet's LoRA adapters (protocol/lora_registry.py): it publishes the
adapters it was started with, and loads one a request names the first time it comes, from the
record a gateway wrote, so that an adapter loaded at runtime through any gateway runs on every
replica."""

from __future__ import annotations

import time

from protocol.keys import Keys
from protocol.lora_registry import LoraRecord
from protocol.messages import MessageDecodeError
from scheduler.engine import LLMEngine
from shared.errors import InvalidRequestError
from shared.logging import get_logger

# How long a scheduler trusts its copy of an adapter's record before reading the registry again.
RECHECK_S = 1.0


class ServiceLoras:
    def __init__(self, client, keys: Keys, model_name: str, engine: LLMEngine) -> None:
        self.client = client
        self.key = keys.loras(model_name)
        self.engine = engine
        self.log = get_logger("tokenfleet.scheduler.loras")
        self._checked_at: dict[str, float] = {}  # adapter name -> when its record was last read

    def publish_declared(self) -> None:
        """Its --lora-modules, as adapters everyone may call (a gateway's own loads are kept)."""
        slots = self.engine.scheduler.lora_slots
        if slots is None or not slots.adapters:
            return
        records = {name: LoraRecord(name, adapter.path, adapter.rank).encode()
                   for name, adapter in slots.adapters.items()}
        self.client.hset(self.key, mapping=records)

    def ensure(self, name: str) -> None:
        """Have the engine serve `name` as the registry says now (InvalidRequestError when the
        fleet has no such adapter, or when this base cannot run it). The registry is read again
        after RECHECK_S: an adapter unloaded, or loaded again from another folder, is seen."""
        now = time.monotonic()
        served = self._served_path(name)
        if served is not None and now - self._checked_at.get(name, 0.0) < RECHECK_S:
            return
        data = self.client.hget(self.key, name)
        self._checked_at[name] = now
        declared = self.engine.config.lora_modules.get(name)
        if data is None and declared is not None and served == declared:
            # One of its --lora-modules, missing from Redis (not written yet, or Redis lost its
            # data) rather than unloaded: written again.
            self.publish_declared()
            return
        if data is None:
            if served is not None:  # unloaded: its running requests finish, new ones are refused
                self.engine.remove_lora(name)
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is registered", param="model")
        try:
            record = LoraRecord.decode(data)
        except MessageDecodeError as exc:
            raise InvalidRequestError(f"LoRA adapter {name!r}: {exc}", param="model") from None
        if served == record.path:
            return
        if served is not None:  # loaded again from another folder: another adapter
            self.engine.remove_lora(name)
        self.engine.add_lora(name, record.path)
        self.log.info("lora_loaded_from_registry", lora_name=name, path=record.path)

    def _served_path(self, name: str) -> str | None:
        slots = self.engine.scheduler.lora_slots
        adapter = slots.adapters.get(name) if slots is not None else None
        return adapter.path if adapter is not None else None
