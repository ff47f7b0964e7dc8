"""The fleet on a real Redis Cluster (3 primaries, 3 replicas): a gateway and a real scheduler
(a tiny llama with SmolLM2's tokenizer, CPU) serve streams, submit-and-poll with resumable
events, and tenants' limits; the same greedy text as on one server."""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio

from gateway.core.settings import GatewaySettings, ModelSpec
from gateway.http.app import create_app
from gateway.tenants.directory import TenantDirectory
from testkit.sse import DONE, data_fields
from tests.fleet_helpers import TINY_CHAT
from tests.gateway.conftest import RealScheduler
from tests.gateway.test_requests_api import parse_sse

pytestmark = [pytest.mark.asyncio, pytest.mark.cluster, pytest.mark.slow]


def chat(i: int, **extra) -> dict:
    return {"model": TINY_CHAT, "messages": [{"role": "user", "content": f"Count to {i}, please."}],
            "max_tokens": 12, "temperature": 0, **extra}


@pytest.fixture(scope="module")
def cluster_scheduler(redis_cluster, tiny_chat):
    scheduler = RealScheduler(redis_cluster.url, tiny_chat, model_name=TINY_CHAT, scheduler_id="cluster-1")
    yield scheduler
    scheduler.close()


@pytest_asyncio.fixture
async def gateway(redis_cluster, tiny_chat, cluster_scheduler, aiohttp_client):
    async def make(**overrides):
        settings = GatewaySettings(redis_url=redis_cluster.url, models=[ModelSpec.from_path(str(tiny_chat))],
                                   poll_s=0.5, **overrides)
        return await aiohttp_client(create_app(settings))

    return make


def _token_events(text: str) -> list[dict]:
    return [json.loads(e["data"]) for e in parse_sse(text) if e.get("event") == "token"]


async def _stream_text(client, body: dict) -> str:
    response = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert response.status == 200, await response.text()
    data = data_fields(await response.text())
    assert data[-1] == DONE
    return "".join(c["delta"].get("content") or "" for d in data[:-1] for c in json.loads(d)["choices"])


async def test_streams_on_every_shard_give_the_same_greedy_text_as_plain_calls(gateway):
    client = await gateway()
    plain = [await client.post("/v1/chat/completions", json=chat(i)) for i in range(3)]
    texts = [(await r.json())["choices"][0]["message"]["content"] for r in plain]
    # 24 streams at once: their request ids fall on every partition, so on all three shards.
    streamed = await asyncio.gather(*(_stream_text(client, chat(i % 3)) for i in range(24)))
    assert streamed == [texts[i % 3] for i in range(24)]


async def test_submit_and_poll_and_resume_events_from_last_event_id(gateway):
    client = await gateway()
    body = {"kind": "completion", "model": TINY_CHAT, "prompt": "Once upon a time", "max_tokens": 16,
            "temperature": 0}
    submitted = await client.post("/v1/requests", json=body)
    assert submitted.status == 202, await submitted.text()
    req_id = (await submitted.json())["id"]
    for _ in range(200):
        view = await (await client.get(f"/v1/requests/{req_id}")).json()
        if view["status"] in ("completed", "failed"):
            break
        await asyncio.sleep(0.05)
    assert view["status"] == "completed", view
    # A finished request's events catch up in one event; resumed after seq 3, the event carries
    # exactly the tokens after the third: no gap, no repeat.
    whole = _token_events(await (await client.get(f"/v1/requests/{req_id}/events")).text())
    resumed = _token_events(await (await client.get(f"/v1/requests/{req_id}/events",
                                                    headers={"Last-Event-ID": "3"})).text())
    all_ids = [t for e in whole for t in e["token_ids"]]
    assert len(all_ids) == 16 and view["output"]["text"] == "".join(e["text"] for e in whole)
    assert [t for e in resumed for t in e["token_ids"]] == all_ids[3:]
    # An Idempotency-Key's retry answers the same request (its id was drawn in the key's partition).
    first = await client.post("/v1/requests", json=body, headers={"Idempotency-Key": "k-1"})
    again = await client.post("/v1/requests", json=body, headers={"Idempotency-Key": "k-1"})
    assert (await first.json())["id"] == (await again.json())["id"]
    assert again.headers["Idempotent-Replayed"] == "true"


async def test_tenants_limits_hold_across_shards(gateway):
    tenants = TenantDirectory.from_map({"tenants": {
        "team-a": {"keys": ["key-a"], "requests_per_minute": 3},
        "team-b": {"keys": ["key-b"], "max_concurrent_requests": 1},
    }})
    client = await gateway(tenants=tenants)
    a = {"Authorization": "Bearer key-a"}
    statuses = [(await client.post("/v1/chat/completions", json=chat(1), headers=a)).status for _ in range(4)]
    assert statuses == [200, 200, 200, 429]
    b = {"Authorization": "Bearer key-b"}
    slow = asyncio.ensure_future(client.post("/v1/chat/completions", json=chat(2, max_tokens=200,
                                                                                 ignore_eos=True), headers=b))
    await asyncio.sleep(0.3)
    second = await client.post("/v1/chat/completions", json=chat(3), headers=b)
    assert second.status == 429 and (await second.json())["error"]["code"] == "max_concurrent_requests"
    assert (await slow).status == 200
    # Its lease ended with it: the next one is admitted.
    assert (await client.post("/v1/chat/completions", json=chat(3), headers=b)).status == 200


async def test_a_batch_job_writes_every_line_once(gateway, redis_cluster):
    from gateway.api.batch.jobs import JobStore
    from protocol.keys import keys_for
    from shared.redis_client import connect_async
    from tests.gateway.batch_fleet import job_lines

    await gateway()  # its batch ingester takes the job in and feeds it
    client = connect_async(redis_cluster.url)
    jobs = JobStore(client, keys_for(redis_cluster.url))
    lines, broken = job_lines(120)
    job_ids = ["cluster-job-1", "cluster-job-2"]  # (two jobs: two partitions, most likely two shards)
    for job_id in job_ids:
        await jobs.create(job_id, {"lines": "\n".join(lines)})
    for job_id in job_ids:
        for _ in range(600):
            job = await jobs.get(job_id)
            if job is not None and job.status in ("completed", "failed"):
                break
            await asyncio.sleep(0.2)
        assert job.status == "completed", job.fields
        outputs = [json.loads(line) for line in await jobs.outputs(job_id)]
        assert len(outputs) == 120  # every line once (a line that is not JSON has no custom_id)
        unreadable = {c for c, kind in broken.items() if kind == "json"}
        named = sorted(o["custom_id"] for o in outputs if o["custom_id"] is not None)
        assert named == sorted(f"req-{i}" for i in range(120) if f"req-{i}" not in unreadable)
        failed = [o["custom_id"] for o in outputs if o.get("error") or o["response"]["status_code"] != 200]
        assert len(failed) == len(broken) and set(failed) - {None} == set(broken) - unreadable
    listed, _ = await jobs.list(limit=10)
    assert {j.id for j in listed} >= set(job_ids)
    await client.aclose()
