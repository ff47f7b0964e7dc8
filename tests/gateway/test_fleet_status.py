"""The gateway's view of the fleet, on a real Redis: every scheduler's engine metrics on its
/metrics, the status page at /, the fleet view at /fleet.json, and its own heartbeat."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.api.ops.presence import gateway_id
from gateway.fleet.engine_metrics import merge_expositions
from protocol import registry
from protocol.keys import Keys
from protocol.messages import DeadLetter
from scheduler.engine_metrics import EngineMetrics
from scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from shared.step import SequenceWork, StepBatch
from tests.gateway.conftest import MODEL

KEYS = Keys()


def _metrics_after_one_prefill(scheduler_id: str, num_prompt_tokens: int) -> EngineMetrics:
    """An engine's metrics after a step that prefilled one prompt (no model needed)."""
    scheduler = Scheduler(SchedulerConfig(max_model_len=64, num_kv_blocks=8))
    metrics = EngineMetrics(scheduler, MODEL, scheduler_id)
    work = SequenceWork("r1", list(range(num_prompt_tokens)), 0, [0], True, None)
    metrics.record_step(SchedulerOutput(StepBatch(0, [work]), {"r1": num_prompt_tokens}, []), [], 0.01)
    return metrics


def _samples(text: str) -> dict[tuple, float]:
    """(name, scheduler label, finished_reason label) -> value."""
    return {(s.name, s.labels.get("scheduler"), s.labels.get("finished_reason")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_merged_expositions_declare_each_family_once_and_keep_every_schedulers_samples():
    texts = [_metrics_after_one_prefill(name, n).exposition() for name, n in (("s0", 5), ("s1", 7))]
    merged = merge_expositions([*texts, b"this is { not prometheus text"]).decode()
    assert merged.count("# TYPE tokenfleet:prompt_tokens_total counter") == 1
    assert merged.count("# TYPE tokenfleet:kv_cache_usage_perc gauge") == 1
    samples = _samples(merged)
    assert samples[("tokenfleet:prompt_tokens_total", "s0", None)] == 5
    assert samples[("tokenfleet:prompt_tokens_total", "s1", None)] == 7
    assert samples[("tokenfleet:iteration_tokens_total_count", "s1", None)] == 1
    assert merge_expositions([]) == b""


@pytest.mark.asyncio
async def test_metrics_serve_the_live_schedulers_engine_metrics_until_their_key_expires(make_client,
                                                                                       redis_server):
    client = await make_client()
    redis = redis_server.client()
    redis.set(KEYS.scheduler_metrics("s0"), _metrics_after_one_prefill("s0", 5).exposition())
    # (s1's key lives 2 s: the first read below must come before it expires, on a loaded machine too)
    redis.set(KEYS.scheduler_metrics("s1"), _metrics_after_one_prefill("s1", 7).exposition(), px=2000)
    for name in ("s0", "s1"):  # (listed in the registry for longer than s1 reports)
        registry.beat(redis, KEYS, registry.SCHEDULERS, name, 60)
    text = await (await client.get("/metrics")).text()
    assert "tokenfleet_gateway_http_requests_total" in text  # the gateway's own are still there
    samples = _samples(text)
    assert samples[("tokenfleet:prompt_tokens_total", "s0", None)] == 5
    assert samples[("tokenfleet:prompt_tokens_total", "s1", None)] == 7
    assert samples[("tokenfleet:request_success_total", "s0", "length")] == 0
    deadline = time.monotonic() + 30
    while redis.exists(KEYS.scheduler_metrics("s1")):  # s1 stopped reporting: its key expires
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    samples = _samples(await (await client.get("/metrics")).text())
    assert ("tokenfleet:prompt_tokens_total", "s1", None) not in samples
    assert samples[("tokenfleet:prompt_tokens_total", "s0", None)] == 5


@pytest.mark.asyncio
async def test_status_page_is_open_and_fleet_json_answers_an_api_key(make_client, fake_scheduler):
    client = await make_client(api_keys=("secret",))
    page = await client.get("/")
    assert page.status == 200 and page.content_type == "text/html"
    html = await page.text()
    assert 'fetch(SOURCE' in html and "fleet.json" in html
    assert "http://" not in html and "https://" not in html  # nothing fetched from elsewhere
    assert (await client.get("/v1/models")).status == 401  # the rest still needs the key
    assert (await client.get("/fleet.json")).status == 401  # the page asks for the key
    for _ in range(50):  # the gateway's first heartbeat is written as it starts
        view = await (await client.get("/fleet.json", headers={"Authorization": "Bearer secret"})).json()
        if view["gateways"]:
            break
        await asyncio.sleep(0.05)
    assert [s["id"] for s in view["schedulers"]] == [fake_scheduler.scheduler_id]
    assert view["throughput_history"]["generation_tokens"] == [0] * 120
    assert view["schedulers"][0]["model"] == MODEL
    assert [g["id"] for g in view["gateways"]] == [gateway_id()]
    assert view["gateways"][0]["models"] == [MODEL]
    kinds = {(q["model"], q["kind"]): q for q in view["queues"]}
    assert kinds[(MODEL, "interactive")]["consumers"] >= 0
    assert view["dead_letters"] == {"count": 0, "recent": []}
    assert view["batch_jobs"] == []
    letter = DeadLetter(KEYS.request_stream(MODEL, "interactive"), "1-0", "delivered 4 times", 4, "r-poison")
    fake_scheduler.client.xadd(KEYS.dead, {"m": letter.encode()})
    fake_scheduler.client.xadd(KEYS.dead, {"junk": b"x"})
    # Two more schedulers' per-second counts: the history sums them, second by second.
    end = int(time.time()) - 2
    for name, counts in (("h1", [[end - 1, 5], [end, 7]]), ("h2", [[end, 3], [end - 500, 99]])):
        fake_scheduler.client.hset(KEYS.scheduler(name), mapping={"model": MODEL,
                                                                   "generation_history": json.dumps(counts)})
        registry.beat(fake_scheduler.client, KEYS, registry.SCHEDULERS, name, 60)
    view = await (await client.get("/fleet.json", headers={"Authorization": "Bearer secret"})).json()
    history = view["throughput_history"]
    if history["end"] == end + 1:  # (a second ticked over)
        history["generation_tokens"] = history["generation_tokens"][1:] + [0]
    assert history["generation_tokens"][-2:] == [5, 10] and sum(history["generation_tokens"]) == 15
    dead = view["dead_letters"]
    assert dead["count"] == 2
    assert dead["recent"][0]["reason"] == "(unreadable entry)"  # newest first
    assert (dead["recent"][1]["req_id"], dead["recent"][1]["reason"]) == ("r-poison", "delivered 4 times")
