"""A request whose deadline passes while it waits in the engine: its record and its events
must name the same terminal state, read the way the gateway reads them."""

from __future__ import annotations

import time

from gateway.serving.records import Delta, ResultRecord
from scheduler.engine import LLMEngine
from service.scheduler_service import SchedulerService, ServiceSettings
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from tests.scheduler.service_client import KEYS, EventRecorder, submit, token_ids

MODEL = "tiny"


def test_a_request_that_expires_waiting_in_the_engine_says_expired_in_record_and_events(
        tiny_checkpoints, redis_server):
    # 16 blocks of 4 tokens: the long request holds 15 of them, the short one (3 blocks) waits.
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", block_size=4,
                                    num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=64))
    service = SchedulerService(engine, redis_server.url, ServiceSettings(MODEL, "s1", heartbeat_s=1e-6))
    client = redis_server.client()
    recorder = EventRecorder(redis_server.url)
    try:
        long_run = submit(client, MODEL, list(range(3, 59)),
                          SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        service.tick()
        # (a deadline far enough that a loaded machine's pause before the next tick stays under it)
        deadline = time.time() + 2.0
        waiting = submit(client, MODEL, list(range(100, 110)), SamplingParams(temperature=0.0, max_tokens=4),
                         deadline=deadline)
        service.tick()
        assert engine.scheduler.get_request(waiting).status.name == "WAITING"  # no blocks for it
        time.sleep(max(0.0, deadline - time.time()) + 0.1)
        service.tick()  # its deadline passed while it waited: it expires before this step
        service.flush_and_wait()
        assert client.hget(KEYS.result(waiting), "state") == b"expired"
        while client.hget(KEYS.result(long_run), "state") != b"completed":
            service.tick()
            service.flush_and_wait()
        recorder.wait_for_end(waiting)
        raw = client.hgetall(KEYS.result(waiting))
    finally:
        recorder.close()
        service.writer.close()
        engine.close()
    record = ResultRecord.parse(waiting, raw)
    assert record.state == "expired" and not token_ids(raw)
    from_record = record.delta_after(0, lambda ids: "")  # GET, and /events replayed from the record
    [event] = recorder.events[waiting]
    live = Delta.from_event(event)  # /events and the OpenAI streams, live
    assert live.state == from_record.state == "expired"
    assert live.error == from_record.error == {"code": "expired",
                                               "message": "the deadline passed while it was queued"}
    assert live.seq == from_record.seq == 1
