"""Fair share through the queue: a tenant's backlog does not hold back another tenant's request.

Time is counted in engine steps (each tick of the service is one step), never on the clock."""

from __future__ import annotations

from scheduler.engine import LLMEngine
from service.scheduler_service import SchedulerService, ServiceSettings
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from tests.scheduler.service_client import KEYS, submit, token_ids

MODEL = "tiny"
SHORT = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
PROMPT = [5, 6, 7, 8]


def _ticks_to_first_token(service: SchedulerService, client, req_id: str, limit: int = 2000) -> int:
    """Ticks (one engine step each) until the request's first token is in its record."""
    for tick in range(1, limit + 1):
        service.tick()
        service.flush_and_wait()
        if token_ids(client.hgetall(KEYS.result(req_id))):
            return tick
    raise AssertionError(f"{req_id} got no token in {limit} steps")


def test_a_500_request_backlog_delays_another_tenants_first_token_by_at_most_two_steps(
        tiny_checkpoints, redis_server):
    config = EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", block_size=4,
                          num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=64)
    client = redis_server.client()
    with LLMEngine(config) as engine:
        service = SchedulerService(engine, redis_server.url, ServiceSettings(MODEL, "s1"))
        # An idle fleet: team-b's request alone.
        idle_id = submit(client, MODEL, PROMPT, SHORT, tenant="team-b")
        idle_steps = _ticks_to_first_token(service, client, idle_id)
        while engine.has_unfinished_requests():
            service.tick()
        # team-a queues 500 requests; the fleet works on them for a while.
        backlog = [submit(client, MODEL, PROMPT, SHORT, tenant="team-a") for _ in range(500)]
        for _ in range(5):
            service.tick()
        # team-b's request, with a lease on its tenant's concurrency as the gateway takes one.
        req_id = "b-after-backlog"
        client.hset(KEYS.result(req_id), mapping={"state": "queued", "tenant": "team-b"})
        client.zadd(KEYS.tenant_leases("team-b"), {req_id: 10**10})
        submit(client, MODEL, PROMPT, SHORT, tenant="team-b", req_id=req_id)
        loaded_steps = _ticks_to_first_token(service, client, req_id)
        while client.hget(KEYS.result(req_id), "state") != b"completed":
            service.tick()
            service.flush_and_wait()
        done_a = sum(client.hget(KEYS.result(r), "state") == b"completed" for r in backlog)
        service.writer.close()
    assert idle_steps == 1
    assert loaded_steps <= idle_steps + 2
    assert done_a < 100  # most of team-a's backlog was still queued when team-b was served
    assert client.zcard(KEYS.tenant_leases("team-b")) == 0  # its lease ended with it


def test_a_dead_schedulers_tenant_entries_are_taken_over_and_finish(tiny_checkpoints, redis_server):
    config = EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", block_size=4,
                          num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=64)
    client = redis_server.client()
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLMEngine(config) as first_engine, LLMEngine(config) as second_engine:
        first = SchedulerService(first_engine, redis_server.url, ServiceSettings(MODEL, "first", lease_s=0.5))
        tenants = ("team-a", "team-b", None)
        ids = [submit(client, MODEL, PROMPT, sampling, tenant=tenant) for tenant in tenants]
        first.tick()  # reads (and claims) all three, then "dies": it never ticks again
        first.flush_and_wait()
        assert all(client.hget(KEYS.result(r), "owner") == b"first" for r in ids)
        second = SchedulerService(second_engine, redis_server.url,
                                  ServiceSettings(MODEL, "second", lease_s=0.5, heartbeat_s=0.1))
        for _ in range(2000):
            second.tick()
            second.flush_and_wait()
            if all(client.hget(KEYS.result(r), "state") == b"completed" for r in ids):
                break
        first.writer.close()
        second.writer.close()
    assert [client.hget(KEYS.result(r), "scheduler") for r in ids] == [b"second"] * 3
    for tenant in ("team-a", "team-b", None):
        stream = KEYS.request_stream(MODEL, "interactive", tenant)
        assert client.xlen(stream) == 0 and client.xpending(stream, "schedulers")["pending"] == 0
