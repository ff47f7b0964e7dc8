"""A scheduler's side of the fleet's adapters (service/lora_adapters.py), on a real Redis: its
--lora-modules published, an adapter a request names loaded from its record, an unloaded one
dropped, one loaded again from another folder registered anew."""

from __future__ import annotations

import pytest
import redis

from protocol.keys import Keys
from protocol.lora_registry import LoraRecord
from scheduler.engine import LLMEngine
from service import lora_adapters as service_loras
from service.lora_adapters import ServiceLoras
from shared.config import EngineConfig
from shared.errors import InvalidRequestError


def test_adapters_follow_the_registry(redis_server, tiny_checkpoints, lora_adapters, monkeypatch) -> None:
    monkeypatch.setattr(service_loras, "RECHECK_S", 0.0)  # every request reads the record again
    first, second, third = (str(path) for path in lora_adapters.values())
    client = redis.Redis.from_url(redis_server.url)
    key = Keys().loras("tiny")
    config = EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=16,
                          enable_lora=True, max_loras=2, lora_modules={"fixed": first})
    with LLMEngine(config, load_tokenizer_files=False) as engine:
        loras = ServiceLoras(client, Keys(), "tiny", engine)
        loras.publish_declared()
        assert LoraRecord.decode(client.hget(key, "fixed")) == LoraRecord("fixed", first, 4)
        with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'late' is registered"):
            loras.ensure("late")
        client.hset(key, "late", LoraRecord("late", second, 8, owner="team-a").encode())
        loras.ensure("late")  # as a gateway's load route wrote it
        assert engine.scheduler.lora_slots.adapters["late"].path == second
        client.hset(key, "late", LoraRecord("late", third, 16, owner="team-a").encode())
        loras.ensure("late")  # loaded again from another folder: another adapter
        assert engine.scheduler.lora_slots.adapters["late"].path == third
        client.hdel(key, "late")  # unloaded
        with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'late'"):
            loras.ensure("late")
        assert engine.lora_names() == ["fixed"]
        client.delete(key)  # Redis lost its data: the scheduler's own adapter is written again
        loras.ensure("fixed")
        assert client.hget(key, "fixed") is not None
