"""A scheduler's side of the fleet's LoRA adapters (protocol/lora_registry.py): it publishes the
adapters it was started with, and loads one a request names the first time it comes, from the
record a gateway wrote, so that an adapter loaded at runtime through any gateway runs on every
replica."""

from __future__ import annotations

from protocol.keys import Keys
from protocol.lora_registry import LoraRecord
from protocol.messages import MessageDecodeError
from scheduler.engine import LLMEngine
from shared.errors import InvalidRequestError
from shared.logging import get_logger


class ServiceLoras:
    def __init__(self, client, keys: Keys, model_name: str, engine: LLMEngine) -> None:
        self.client = client
        self.key = keys.loras(model_name)
        self.engine = engine
        self.log = get_logger("tokenfleet.scheduler.loras")

    def publish_declared(self) -> None:
        """Its --lora-modules, as adapters everyone may call (a gateway's own loads are kept)."""
        slots = self.engine.scheduler.lora_slots
        if slots is None or not slots.adapters:
            return
        records = {name: LoraRecord(name, adapter.path, adapter.rank).encode()
                   for name, adapter in slots.adapters.items()}
        self.client.hset(self.key, mapping=records)

    def ensure(self, name: str) -> None:
        """Have the engine serve `name` (InvalidRequestError when the fleet has no such adapter,
        or when this base cannot run it)."""
        if name in self.engine.lora_names():
            return
        data = self.client.hget(self.key, name)
        if data is None:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is registered", param="model")
        try:
            record = LoraRecord.decode(data)
        except MessageDecodeError as exc:
            raise InvalidRequestError(f"LoRA adapter {name!r}: {exc}", param="model") from None
        self.engine.add_lora(name, record.path)
        self.log.info("lora_loaded_from_registry", lora_name=name, path=record.path)
