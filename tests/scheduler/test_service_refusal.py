"""A request the engine itself refuses fails with the error code `invalid_request` and the
engine's own message: a code in the record, not an "invalid: " prefix parsed back from text."""

from __future__ import annotations

import json

from protocol.messages import DeadLetter
from scheduler.engine import LLMEngine
from service.scheduler_service import SchedulerService, ServiceSettings
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from tests.scheduler.service_client import KEYS, submit


def test_an_input_the_engine_refuses_fails_with_the_invalid_request_code(tiny_checkpoints, redis_server):
    client = redis_server.client()
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", block_size=4,
                                    num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64))
    service = SchedulerService(engine, redis_server.url, ServiceSettings("tiny", "a", idle_block_ms=10))
    try:
        req_id = submit(client, "tiny", [], SamplingParams(max_tokens=4))  # an empty prompt
        service.tick()
        service.flush_and_wait()
        record = client.hgetall(KEYS.result(req_id))
        assert record[b"state"] == b"failed"
        assert json.loads(record[b"error"]) == {"code": "invalid_request", "message": "the prompt is empty"}
        (_, fields), = client.xrange(KEYS.dead)
        assert DeadLetter.decode(fields[b"m"]).reason == "invalid: the prompt is empty"  # (operators' text)
    finally:
        service.writer.close()
        engine.close()
