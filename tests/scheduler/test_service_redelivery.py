"""An entry delivered again while this scheduler's engine still holds its request (a takeover
on a loaded machine, or a duplicate entry) is recognised, not started twice and not failed.

Two services on one real Redis, ticked by hand so that each interleaving is exact: "a stall"
is simply a service that is not ticked for longer than the lease.
"""

from __future__ import annotations

import threading
import time

from protocol.keys import CONSUMER_GROUP
from protocol.messages import ErrorEvent
from scheduler.engine import LLMEngine
from service.scheduler_service import SchedulerService, ServiceSettings
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from tests.scheduler.service_client import KEYS, EventRecorder, submit, token_ids, wait_terminal

MODEL = "tiny"
LEASE_S = 0.5  # far above a tick of the tiny model, even on a loaded machine
SAMPLING = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPT = [5, 17, 3, 99, 42, 8]


def _engine(folder) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=256,
                                  max_num_seqs=8, max_num_batched_tokens=256))


def _service(engine: LLMEngine, url: str, name: str) -> SchedulerService:
    # heartbeat_s ~0: maintenance (renewal, takeover) runs in every tick.
    return SchedulerService(engine, url, ServiceSettings(MODEL, name, lease_s=LEASE_S, heartbeat_s=1e-6,
                                                         idle_block_ms=10))


def _tick(service: SchedulerService) -> None:
    service.tick()
    service.flush_and_wait()


def _stall() -> None:
    """Nobody ticks (renews) for longer than the lease."""
    time.sleep(LEASE_S * 1.5)


def _lose_to_b(a: SchedulerService, b: SchedulerService, client, req_id: str) -> None:
    """a runs req_id, stalls past the lease, b takes it over, then a's next step is refused: the
    writer tells a it lost the request, which a learns at its next tick."""
    while len(token_ids(client.hgetall(KEYS.result(req_id)))) < 3:
        _tick(a)
    _stall()
    _tick(b)  # takes the entry over, claims the record, runs a step
    assert req_id in b.inflight and client.hget(KEYS.result(req_id), "owner") == b"b"
    _tick(a)  # renews the entry (still its own, it thinks), steps: the write is refused
    assert req_id in a.inflight


def _finish(a: SchedulerService, b: SchedulerService, client, req_id: str) -> dict:
    deadline = time.monotonic() + 60
    while client.hget(KEYS.result(req_id), "state") not in (b"completed", b"failed", b"cancelled"):
        assert time.monotonic() < deadline, client.hgetall(KEYS.result(req_id))
        for _ in range(4):
            _tick(b)
        _tick(a)  # now and then: a must leave the request alone
    return client.hgetall(KEYS.result(req_id))


def _check_served_once(a: SchedulerService, b: SchedulerService, client, recorder: EventRecorder,
                       req_id: str, record: dict, want: list[int]) -> None:
    assert record[b"state"] == b"completed", record
    assert token_ids(record) == want
    recorder.wait_for_end(req_id)
    events = recorder.events[req_id]
    assert not [e for e in events if isinstance(e, ErrorEvent)]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))  # no gap, no repeat
    assert sum((e.token_ids for e in events), []) == want
    assert client.xlen(KEYS.dead) == 0
    # Every entry of it is acknowledged in the end (a leftover one by whoever takes it over next).
    stream = KEYS.request_stream(MODEL, "interactive")
    deadline = time.monotonic() + 30
    while client.xpending(stream, CONSUMER_GROUP)["pending"]:
        assert time.monotonic() < deadline, client.xpending_range(stream, CONSUMER_GROUP, "-", "+", 10)
        _stall()
        _tick(a)
        _tick(b)
    assert client.hget(KEYS.result(req_id), "state") == b"completed"


def test_own_pending_entry_taken_back_right_after_losing_it_is_not_started_twice(tiny_checkpoints,
                                                                                 redis_server):
    """a loses the request, and in the same tick its takeover finds the entry (still in a's
    pending list, idle past the lease because b stalled too): the engine still holds the
    aborted request, so admitting it again failed it with "request id ... is already in use"."""
    folder = tiny_checkpoints["llama"]
    with _engine(folder) as engine:
        want = engine.generate([PROMPT], SAMPLING)[0].token_ids
    client = redis_server.client()
    recorder = EventRecorder(redis_server.url)
    a, b = (_service(_engine(folder), redis_server.url, name) for name in ("a", "b"))
    try:
        req_id = submit(client, MODEL, PROMPT, SAMPLING)
        _lose_to_b(a, b, client, req_id)
        _stall()  # b stalls as well (its first step after a takeover recomputes the prompt)
        _tick(a)  # drops the lost request; its takeover finds the entry idle past the lease
        assert req_id not in a.inflight
        assert a.engine.scheduler.get_request(req_id) is None  # the abort was reported, not a restart
        assert client.hget(KEYS.result(req_id), "owner") == b"b"  # a did not claim it back
        # Read by a, taken over by b: a's look at it does not count towards poison.
        stream = KEYS.request_stream(MODEL, "interactive")
        assert client.xpending_range(stream, CONSUMER_GROUP, "-", "+", 1)[0]["times_delivered"] == 2
        record = _finish(a, b, client, req_id)
        assert record[b"scheduler"] == b"b"
        _check_served_once(a, b, client, recorder, req_id, record, want)
    finally:
        recorder.close()
        for service in (a, b):
            service.writer.close()
            service.engine.close()


def test_duplicate_entry_read_in_the_tick_that_drops_the_lost_request_is_not_an_error(tiny_checkpoints,
                                                                                      redis_server):
    """A second entry of the same request (a client library that sent the queueing call again
    after a timeout) read in the tick where a learns it lost the request to b."""
    folder = tiny_checkpoints["llama"]
    with _engine(folder) as engine:
        want = engine.generate([PROMPT], SAMPLING)[0].token_ids
    client = redis_server.client()
    recorder = EventRecorder(redis_server.url)
    a, b = (_service(_engine(folder), redis_server.url, name) for name in ("a", "b"))
    try:
        req_id = submit(client, MODEL, PROMPT, SAMPLING)
        _lose_to_b(a, b, client, req_id)
        submit(client, MODEL, PROMPT, SAMPLING, req_id=req_id)  # the duplicate entry
        time.sleep(0.01)  # past the admission poll interval: a's next tick reads the streams
        _tick(a)  # drops the lost request, then reads the duplicate
        assert req_id not in a.inflight
        assert client.hget(KEYS.result(req_id), "owner") == b"b"
        assert client.hget(KEYS.result(req_id), "state") == b"running"
        record = _finish(a, b, client, req_id)
        _check_served_once(a, b, client, recorder, req_id, record, want)
    finally:
        recorder.close()
        for service in (a, b):
            service.writer.close()
            service.engine.close()


def test_leftover_entry_of_a_completed_request_delivered_often_is_acknowledged_not_dead_lettered(
        tiny_checkpoints, redis_server):
    """A duplicate entry outlives its request (it sat pending, taken over lease after lease):
    counted as poison first, it flipped the completed record to failed."""
    client = redis_server.client()
    a = _service(_engine(tiny_checkpoints["llama"]), redis_server.url, "a")
    stream = KEYS.request_stream(MODEL, "interactive")
    try:
        req_id = submit(client, MODEL, PROMPT, SAMPLING)
        while client.hget(KEYS.result(req_id), "state") != b"completed":
            _tick(a)
        completed = client.hgetall(KEYS.result(req_id))
        submit(client, MODEL, PROMPT, SAMPLING, req_id=req_id)  # the leftover duplicate
        entry_id = client.xrange(stream)[-1][0]
        client.xreadgroup(CONSUMER_GROUP, "other", {stream: ">"}, count=1)
        for _ in range(4):
            client.xclaim(stream, CONSUMER_GROUP, "other", 0, [entry_id])
        _stall()
        _tick(a)  # takes it over, delivery 6
        assert client.hgetall(KEYS.result(req_id)) == completed
        assert client.xlen(KEYS.dead) == 0
        assert client.xpending(stream, CONSUMER_GROUP)["pending"] == 0 and client.xlen(stream) == 0
    finally:
        a.writer.close()
        a.engine.close()


def test_a_scheduler_whose_steps_outlast_the_lease_keeps_its_requests(tiny_checkpoints, redis_server):
    """A loaded CPU: every step of a takes twice the lease. Its claims are renewed meanwhile, so b,
    running beside it, takes nothing over (before: each of a's requests moved to b, and back)."""
    folder = tiny_checkpoints["llama"]
    engine = _engine(folder)
    step = engine.step

    def slow_step():
        time.sleep(LEASE_S * 2)  # (sleeps without the GIL, as a long forward pass does)
        return step()

    engine.step = slow_step
    client = redis_server.client()
    settings = dict(lease_s=LEASE_S, heartbeat_s=0.1, idle_block_ms=10)
    a = SchedulerService(engine, redis_server.url, ServiceSettings(MODEL, "a", **settings))
    b = SchedulerService(_engine(folder), redis_server.url, ServiceSettings(MODEL, "b", **settings))
    stops = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=a.run, args=(stops[0],), daemon=True),
               threading.Thread(target=b.run, args=(stops[1],), daemon=True)]
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    try:
        threads[0].start()
        ids = [submit(client, MODEL, [7 + i, 11, 13], short) for i in range(3)]
        deadline = time.monotonic() + 30
        while len(a.inflight) < len(ids):
            assert time.monotonic() < deadline, "a did not take the requests"
            time.sleep(0.01)
        threads[1].start()
        records = wait_terminal(client, ids, timeout_s=120)
    finally:
        for stop, thread in zip(stops, threads, strict=True):
            stop.set()
            if thread.is_alive():
                thread.join(timeout=30)
        for service in (a, b):
            service.writer.close()
            service.engine.close()
    for req_id in ids:
        assert records[req_id][b"state"] == b"completed", records[req_id]
        assert records[req_id][b"scheduler"] == b"a" and b"resumed_from_seq" not in records[req_id]
    assert client.xlen(KEYS.dead) == 0
