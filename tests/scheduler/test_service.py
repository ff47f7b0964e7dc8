"""The scheduler service against a real Redis server and the real engine on tiny models."""

from __future__ import annotations

import random
import threading
import time

from protocol import lua
from protocol.keys import CONSUMER_GROUP
from protocol.messages import DeadLetter
from scheduler.engine import LLMEngine
from service.scheduler_service import SchedulerService, ServiceSettings
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from tests.scheduler.service_client import KEYS, EventRecorder, submit, token_ids, wait_terminal

MODEL = "tiny"
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _engine(folder, **overrides) -> LLMEngine:
    config = dict(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=512, max_num_seqs=16,
                  max_num_batched_tokens=256)
    return LLMEngine(EngineConfig(**{**config, **overrides}))


def _service(engine, url, name="s1", **settings) -> SchedulerService:
    return SchedulerService(engine, url, ServiceSettings(MODEL, name, **{"lease_s": 2.0, **settings}))


class Running:
    """A service looping in a thread until stopped."""

    def __init__(self, service: SchedulerService) -> None:
        self.service = service
        self.stop = threading.Event()
        self.thread = threading.Thread(target=service.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(2, 30))] for _ in range(n)]


def test_200_requests_through_two_schedulers_end_exactly_once(tiny_checkpoints, redis_server):
    folder = tiny_checkpoints["qwen2"]
    prompts = _prompts(200)
    with _engine(folder) as engine:
        expected = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    recorder = EventRecorder(redis_server.url)
    client = redis_server.client()
    services = [Running(_service(_engine(folder), redis_server.url, f"s{i}")) for i in range(2)]
    try:
        ids = [submit(client, MODEL, p, GREEDY) for p in prompts]
        records = wait_terminal(client, ids)
    finally:
        for s in services:
            s.close()
            s.service.engine.close()
        recorder.close()
    for req_id, want in zip(ids, expected, strict=True):
        assert records[req_id][b"state"] == b"completed"
        assert token_ids(records[req_id]) == want
        events = recorder.events[req_id]
        assert [e.seq for e in events] == list(range(1, len(events) + 1))  # no gap, no repeat
        assert sum((e.token_ids for e in events), []) == want
        assert [e.finish_reason for e in events].count("length") == 1
    served = {records[r][b"scheduler"] for r in ids}
    assert served == {b"s0", b"s1"}  # both did work
    for stream in (KEYS.request_stream(MODEL, "interactive"),):
        assert client.xpending(stream, CONSUMER_GROUP)["pending"] == 0
        assert client.xlen(stream) == 0  # acknowledged and deleted


def test_cancelled_request_stops_within_one_step_and_frees_its_blocks(tiny_checkpoints, redis_server):
    engine = _engine(tiny_checkpoints["llama"])
    service = _service(engine, redis_server.url)
    client = redis_server.client()
    stop = threading.Event()
    listener = threading.Thread(target=service._listen_for_cancels, args=(stop,), daemon=True)
    listener.start()
    long_run = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    req_id = submit(client, MODEL, _prompts(1)[0], long_run)
    while len(token_ids(client.hgetall(KEYS.result(req_id)))) < 3:
        service.tick()
        service.flush_and_wait()
    assert engine.scheduler.block_manager.num_free_blocks < 512
    client.set(KEYS.cancelled(req_id), 1, ex=60)
    client.publish(KEYS.cancel_channel, req_id)
    while not service._cancel_ids:
        time.sleep(0.01)
    before = len(token_ids(client.hgetall(KEYS.result(req_id))))
    service.tick()  # one step
    service.flush_and_wait()
    record = client.hgetall(KEYS.result(req_id))
    stop.set()
    listener.join(timeout=5)
    engine.close()
    assert record[b"state"] == b"cancelled"
    assert len(token_ids(record)) == before
    assert engine.scheduler.block_manager.num_free_blocks == 512


def test_poison_entries_land_in_dead_and_service_keeps_serving(tiny_checkpoints, redis_server):
    engine = _engine(tiny_checkpoints["llama"])
    client = redis_server.client()
    stream = KEYS.request_stream(MODEL, "interactive")
    service = _service(engine, redis_server.url, max_deliveries=3)
    service._ensure_groups()
    client.xadd(stream, {"m": b"\xc1 not msgpack"})
    bad = submit(client, MODEL, [1, 2, 99999], GREEDY)  # token id outside the vocabulary
    # An entry that keeps failing: a consumer takes it and never finishes, four times over.
    crashing = submit(client, MODEL, [5, 6, 7], GREEDY)
    entry_id = client.xrange(stream)[-1][0]
    client.xreadgroup(CONSUMER_GROUP, "crasher", {stream: ">"}, count=10)  # takes all three
    for _ in range(3):
        client.xclaim(stream, CONSUMER_GROUP, "crasher", 0, [entry_id])
    good = submit(client, MODEL, [8, 9, 10], GREEDY)
    running = Running(service)
    try:
        time.sleep(2.5)  # the crasher's entries pass the 2 s lease
        records = wait_terminal(client, [bad, crashing, good], timeout_s=60)
    finally:
        running.close()
        engine.close()
    letters = [DeadLetter.decode(fields[b"m"]) for _, fields in client.xrange(KEYS.dead)]
    reasons = {letter.req_id: letter.reason for letter in letters}
    assert any(letter.req_id is None and "undecodable" in letter.reason for letter in letters)
    assert "outside the vocabulary" in reasons[bad]
    assert "delivered" in reasons[crashing]
    assert records[bad][b"state"] == records[crashing][b"state"] == b"failed"
    assert records[good][b"state"] == b"completed"


def test_redis_restart_mid_run_and_the_run_completes(tiny_checkpoints, redis_server):
    folder = tiny_checkpoints["qwen3"]
    prompts = _prompts(30, seed=3)
    sampling = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with _engine(folder, max_num_seqs=8) as engine:  # (the service's engine, batch sizes alike)
        expected = [r.token_ids for r in engine.generate(prompts, sampling)]
    client = redis_server.client()
    engine = _engine(folder, max_num_seqs=8)
    running = Running(_service(engine, redis_server.url))
    try:
        ids = [submit(client, MODEL, p, sampling) for p in prompts]
        while sum(client.hget(KEYS.result(r), "state") == b"completed" for r in ids) < 3:
            time.sleep(0.05)
        redis_server.stop()
        time.sleep(1.0)  # the service keeps retrying meanwhile
        redis_server.start()
        records = wait_terminal(redis_server.client(), ids, timeout_s=120)
    finally:
        running.close()
        engine.close()
    assert [token_ids(records[r]) for r in ids] == expected


def test_expired_and_pre_cancelled_requests_never_run(tiny_checkpoints, redis_server):
    engine = _engine(tiny_checkpoints["llama"])
    client = redis_server.client()
    expired = submit(client, MODEL, [3, 4], GREEDY, deadline=time.time() - 1)
    cancelled = submit(client, MODEL, [3, 4], GREEDY)
    client.set(KEYS.cancelled(cancelled), 1, ex=60)
    running = Running(_service(engine, redis_server.url, result_ttl_s=600))
    try:
        records = wait_terminal(client, [expired, cancelled], timeout_s=30)
    finally:
        running.close()
        engine.close()
    assert records[expired][b"state"] == b"expired"
    assert records[cancelled][b"state"] == b"cancelled"
    assert not token_ids(records[expired]) and not token_ids(records[cancelled])
    assert b"started_at" not in records[expired] and b"started_at" not in records[cancelled]  # never ran
    assert 0 < client.ttl(KEYS.result(expired)) <= 600


def test_an_interactive_arrival_preempts_batch_items_holding_every_slot(tiny_checkpoints, redis_server):
    """Batch items fill the engine; an interactive request still gets read (batch items do not
    count against it) and runs in the next step, a batch item preempted for its slot. Batch
    items publish no per-token events and notify the ingesters when they end."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    engine = _engine(tiny_checkpoints["llama"], max_num_seqs=4)
    service = _service(engine, redis_server.url)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    batch_ids = [submit(client, MODEL, prompt, long, kind="batch", req_id=f"job1.{i}.0", batch_job_id="job1",
                        custom_id=f"c{i}") for i, prompt in enumerate(_prompts(6))]
    recorder = EventRecorder(redis_server.url)
    try:
        while engine.scheduler.num_running_requests < 4:
            service.tick()
        assert {f.req_id for f in service.inflight.values()} <= set(batch_ids)
        interactive = submit(client, MODEL, _prompts(1, seed=9)[0], GREEDY)
        service.tick()  # reads it although the engine is full, and runs it in this step
        request = engine.scheduler.get_request(interactive)
        assert request is not None and request.status.name == "RUNNING"
        assert engine.scheduler.num_running_requests == 4
        preempted = [r for r in batch_ids if (q := engine.scheduler.get_request(r)) is not None
                     and q.status.name == "PREEMPTED"]
        assert len(preempted) == 1
        records = wait_terminal_ticking(service, client, [interactive, *batch_ids])
        assert all(rec[b"state"] == b"completed" for rec in records.values())
        assert all(len(token_ids(records[r])) == 40 for r in batch_ids)
        notices = client.xrange(KEYS.batch_done)
        assert sorted(f[b"req"].decode() for _, f in notices) == sorted(batch_ids)  # one each
        recorder.wait_for_end(interactive)  # (batch items, ended before it or not, publish nothing)
        assert not set(batch_ids) & set(recorder.events)
    finally:
        recorder.close()
        engine.close()


def wait_terminal_ticking(service, client, req_ids, timeout_s: float = 120) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        service.tick()
        service.flush_and_wait()
        records = {r: client.hgetall(KEYS.result(r)) for r in req_ids}
        if all(rec.get(b"state") in (b"completed", b"failed", b"cancelled") for rec in records.values()):
            return records
    raise TimeoutError("requests did not end")


def test_a_scheduler_whose_consumer_group_vanished_makes_it_again(tiny_checkpoints, redis_server):
    """FLUSHALL (or a Redis restarted without its data) drops the streams and their group; the
    next submit recreates the stream without one. The scheduler must not die of NOGROUP."""
    engine = _engine(tiny_checkpoints["llama"])
    client = redis_server.client()
    running = Running(_service(engine, redis_server.url))
    try:
        first = submit(client, MODEL, [3, 4, 5], GREEDY)
        wait_terminal(client, [first], timeout_s=30)
        client.flushall()
        second = submit(client, MODEL, [3, 4, 5], GREEDY)
        records = wait_terminal(client, [second], timeout_s=30)
        assert records[second][b"state"] == b"completed"
        assert running.thread.is_alive()
    finally:
        running.close()
        engine.close()


def test_text_made_by_the_publisher_matches_the_engines_text(smollm2, redis_server):
    """The publisher process decodes tokens (stop strings stay in the engine): the
    streamed text must be what the in-process engine makes, for requests that end on EOS, on a
    stop token id, on length, and on a stop string."""
    config = dict(model=str(smollm2), dtype="float32", num_kv_blocks=256, max_num_seqs=8)
    questions = ["What is the capital of France?", "Écris un mot en français avec des accents.",
                 "Name three colours.", "Write one emoji and nothing else."]
    samplings = [SamplingParams(temperature=0.0, max_tokens=40),  # ends on EOS
                 SamplingParams(temperature=0.0, max_tokens=24),
                 SamplingParams(temperature=0.0, max_tokens=30, stop=[","]),  # a stop string
                 SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    with LLMEngine(EngineConfig(**config)) as engine:
        prompts = [engine.encode(q, chat=True) for q in questions]
        # A stop token id: the third token the first request makes, so that it ends there.
        first = engine.generate([prompts[0]], samplings[0])[0]
        samplings[1] = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[first.token_ids[2]])
        prompts[1] = prompts[0]
        want = [r.text for r in engine.generate(prompts, samplings)]
        assert engine.scheduler.text_for_stop_strings_only is False
    client = redis_server.client()
    with LLMEngine(EngineConfig(**config)) as engine:
        service = _service(engine, redis_server.url)
        ids = [submit(client, MODEL, p, s) for p, s in zip(prompts, samplings, strict=True)]
        records = wait_terminal_ticking(service, client, ids)
    assert [records[r][b"text"].decode() for r in ids] == want
    assert records[ids[0]][b"finish_reason"] == b"stop" and records[ids[1]][b"stop_reason"] == str(
        first.token_ids[2]).encode()
    assert all(text for text in want[:3])


def test_a_burst_of_requests_is_claimed_in_one_round_trip(tiny_checkpoints, redis_server):
    """Admission claims every record it read, and reads their cancel flags, in one script call
    (per partition: one on one server): 500 requests at once must not cost 1,000 round trips on
    the engine thread."""
    engine = _engine(tiny_checkpoints["llama"])
    service = _service(engine, redis_server.url)
    client = redis_server.client()
    service._ensure_groups()
    ids = [submit(client, MODEL, prompt, GREEDY) for prompt in _prompts(12)]
    cancelled = ids[3]
    client.set(KEYS.cancelled(cancelled), 1, ex=60)

    def calls(command: str) -> int:
        return client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)

    client.script_load(lua.Script("claim").source)  # (a first call would be refused, then sent again)
    before = {c: calls(c) for c in ("evalsha", "exists", "hgetall")}
    service._admit(block=False)
    assert calls("evalsha") - before["evalsha"] == 1
    assert calls("hgetall") - before["hgetall"] == 12 and calls("exists") - before["exists"] == 12
    assert len(service.inflight) == 11 and cancelled not in service.inflight
    records = wait_terminal_ticking(service, client, ids)
    assert records[cancelled][b"state"] == b"cancelled"
    assert all(records[r][b"state"] == b"completed" for r in ids if r != cancelled)
    engine.close()
