"""The admission reader (service/admission_reader.py) in a running service, on a real Redis and
the real engine: arrivals are read off the engine thread while a step runs and started at the
next tick; reads never go past the engine's room; entries read and not yet started are this
scheduler's (renewed) and, when it dies, a successor's."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from protocol.keys import CONSUMER_GROUP
from protocol.messages import RequestMessage
from scheduler.engine import LLMEngine
from service import stream_reads
from service.scheduler_service import SchedulerService, ServiceSettings
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from tests.fleet_helpers import wait_heartbeat
from tests.scheduler.service_client import KEYS, submit, wait_terminal
from tokenfleet.supervise import spawn, stop_group

MODEL = "tiny"
PROMPT = [5, 17, 3, 99, 42, 8]


def _engine(folder, **overrides) -> LLMEngine:
    config = dict(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=8,
                  max_num_batched_tokens=256)
    return LLMEngine(EngineConfig(**{**config, **overrides}))


class Running:
    """A service looping in a thread (its engine thread) until closed."""

    def __init__(self, service: SchedulerService) -> None:
        self.service = service
        self.stop = threading.Event()
        self.thread = threading.Thread(target=service.run, args=(self.stop,), name="engine", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self.service.engine.close()


def _spy_on_reads(monkeypatch) -> list[threading.Thread]:
    """The thread of every stream read (XREADGROUP) the service sends from now on."""
    threads: list[threading.Thread] = []
    queue_reads = stream_reads.queue_reads

    def spy(*args, **kwargs):
        threads.append(threading.current_thread())
        return queue_reads(*args, **kwargs)

    monkeypatch.setattr(stream_reads, "queue_reads", spy)
    return threads


def test_an_arrival_during_a_step_starts_at_the_next_tick_with_no_read_on_the_engine_thread(
        tiny_checkpoints, redis_server, monkeypatch):
    reads = _spy_on_reads(monkeypatch)
    engine = _engine(tiny_checkpoints["llama"])
    step = engine.step
    late: list[str] = []  # the request sent while a step ran
    started_at_step: list[bool] = []  # per step: whether it was in the engine when the step began
    is_slow, in_step = threading.Event(), threading.Event()

    def observed_step():
        started_at_step.append(bool(late) and engine.scheduler.get_request(late[0]) is not None)
        if is_slow.is_set():
            in_step.set()
            time.sleep(0.3)  # (the arrival lands meanwhile)
        return step()

    engine.step = observed_step
    client = redis_server.client()
    running = Running(SchedulerService(engine, redis_server.url, ServiceSettings(MODEL, "s1", lease_s=5.0)))
    try:
        first = submit(client, MODEL, PROMPT, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
        while engine.scheduler.get_request(first) is None:
            time.sleep(0.01)
        is_slow.set()
        in_step.clear()
        assert in_step.wait(timeout=30)
        num_steps = len(started_at_step)  # the step running now is the last one counted
        late.append(submit(client, MODEL, PROMPT, SamplingParams(temperature=0.0, max_tokens=4)))
        is_slow.clear()
        deadline = time.monotonic() + 30
        while len(started_at_step) <= num_steps:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert started_at_step[num_steps], "the arrival was not started at the tick after its step"
        records = wait_terminal(client, [first, late[0]], timeout_s=60)
        assert all(record[b"state"] == b"completed" for record in records.values())
    finally:
        running.close()
    assert reads, "nothing was read"
    assert running.thread not in reads, "the engine thread read the streams"


def test_the_reader_never_holds_more_entries_than_the_engine_has_room_for(tiny_checkpoints, redis_server):
    """Two slots, seven streams with a backlog each (four tenants, the plain stream, the own one):
    at the start of every step, this scheduler's pending entries (in the engine, or read and not
    yet started) never outnumber the slots (the entries of requests that ended and whose write
    has not landed aside). Slow steps give the reader time to read."""
    max_num_seqs = 2
    engine = _engine(tiny_checkpoints["llama"], max_num_seqs=max_num_seqs)
    client = redis_server.client()
    service = SchedulerService(engine, redis_server.url, ServiceSettings(MODEL, "s1", lease_s=5.0))
    streams = [KEYS.request_stream(MODEL, "interactive", tenant) for tenant in (None, "t1", "t2", "t3", "t4")]
    streams.append(service.replica_streams.own)
    step = engine.step
    over: list[tuple[int, int]] = []  # (pending entries, finishing) where they were too many

    def observed_step():
        pending = sum(next((c["pending"] for c in client.xpending(s, CONSUMER_GROUP)["consumers"]
                            if c["name"] == b"s1"), 0) for s in streams if client.exists(s))
        if pending - len(service._finishing) > max_num_seqs:
            over.append((pending, len(service._finishing)))
        time.sleep(0.05)
        return step()

    engine.step = observed_step
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    ids = [submit(client, MODEL, PROMPT, short, tenant=tenant) for tenant in (None, "t1", "t2", "t3", "t4")
           for _ in range(3)]
    service._ensure_groups()
    for i in range(3):  # as the gateway routes to a replica: into its own stream
        message_id = f"own-{i}"
        message = RequestMessage.make(message_id, MODEL, PROMPT, short, arrival_time=time.time())
        client.xadd(service.replica_streams.own, {"m": message.encode()})
        ids.append(message_id)
    running = Running(service)
    try:
        records = wait_terminal(client, ids, timeout_s=120)
    finally:
        running.close()
    assert all(record[b"state"] == b"completed" for record in records.values())
    assert not over, over


@pytest.mark.slow
def test_entries_read_but_not_started_are_renewed_and_a_successor_takes_them_after_a_kill(
        tiny_checkpoints, redis_server, tmp_path):
    """a's every step outlasts the lease. Two requests sent during a step are read at once and
    wait for the next tick; their claims are renewed meanwhile (b, beside a, could take them
    otherwise). Then a is killed -9 before it starts them: b takes them over and serves them."""
    lease_s = 1.0
    client = redis_server.client()
    folder = tiny_checkpoints["llama"]
    argv = [sys.executable, "-m", "tests.scheduler.slow_scheduler", redis_server.url, str(folder), "a", "4",
            str(lease_s)]
    a = spawn(argv, tmp_path / "a.log")
    b = None
    stream = KEYS.request_stream(MODEL, "interactive")
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    try:
        wait_heartbeat(client, "a", a)
        first = submit(client, MODEL, PROMPT, sampling)
        while not client.get("test:steps:a"):
            assert a.poll() is None, (tmp_path / "a.log").read_text()
            time.sleep(0.01)
        step = client.get("test:steps:a")
        waiting = [submit(client, MODEL, [7 + i, 11, 13], sampling) for i in range(2)]
        deadline = time.monotonic() + 1.0

        def pending_of_a() -> dict[str, int]:
            return {p["message_id"].decode(): p["time_since_delivered"]
                    for p in client.xpending_range(stream, CONSUMER_GROUP, "-", "+", 10, consumername="a")}

        while len(pending_of_a()) < 3:
            assert time.monotonic() < deadline, f"a did not read them during its step: {pending_of_a()}"
            time.sleep(0.01)
        time.sleep(lease_s * 1.5)
        assert client.get("test:steps:a") == step, "the step ended: the test's timing did not hold"
        assert all(client.hget(KEYS.result(r), "owner") is None for r in waiting)  # read, not started
        idle_ms = pending_of_a()
        assert max(idle_ms.values()) < lease_s * 1000, idle_ms  # renewed while they wait
        stop_group(a, graceful=False)  # kill -9 mid-step
        b = Running(SchedulerService(_engine(folder), redis_server.url,
                                     ServiceSettings(MODEL, "b", lease_s=lease_s, heartbeat_s=0.1)))
        records = wait_terminal(client, [first, *waiting], timeout_s=60)
    finally:
        stop_group(a, graceful=False)
        if b is not None:
            b.close()
    for req_id in [first, *waiting]:
        assert records[req_id][b"state"] == b"completed", records[req_id]
        assert records[req_id][b"scheduler"] == b"b"
    assert client.xpending(stream, CONSUMER_GROUP)["pending"] == 0
