"""Chats beside a batch job on a scheduler whose slots the batch fills: each chat takes a batch
item's slot (the item is preempted and recomputed later), and every line of the job is still
written exactly once, with the answer it gets without preemption."""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio
import redis

from gateway.core.settings import GatewaySettings, ModelSpec
from gateway.http.app import create_app
from tests.gateway.batch_fleet import TINY_CHAT, job_lines, read_outputs, wait_for_job, wait_written
from tests.gateway.conftest import RealScheduler

pytestmark = [pytest.mark.slow]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def scheduler(module_redis, tiny_chat):
    # Four slots: the job holds every one of them while it runs.
    scheduler = RealScheduler(module_redis.url, tiny_chat, model_name=TINY_CHAT, scheduler_id="preempt-1",
                              num_kv_blocks=1024, max_num_seqs=4, max_num_batched_tokens=256)
    yield scheduler
    scheduler.close()


@pytest_asyncio.fixture
async def gateway(module_redis, tiny_chat, aiohttp_client):
    settings = GatewaySettings(redis_url=module_redis.url, models=[ModelSpec.from_path(str(tiny_chat))],
                               poll_s=0.5, batch_lease_s=2.0)
    return await aiohttp_client(create_app(settings))


def num_preemptions(scheduler: RealScheduler) -> float:
    metrics = scheduler.service.telemetry.metrics
    return sum(sample.value for family in metrics.registry.collect() for sample in family.samples
               if sample.name == "tokenfleet:num_preemptions_total")


@pytest.mark.asyncio
async def test_chats_preempt_batch_items_and_every_line_is_written_once_with_its_own_answer(
        scheduler, gateway, module_redis):
    plain = redis.Redis.from_url(module_redis.url)
    lines, _ = job_lines(40, bad=False, max_tokens=MAX_TOKENS, chat_only=True)
    plain.xadd("tf:batch:in", {"job_id": "preempt-1", "lines": "\n".join(lines)})
    await asyncio.to_thread(wait_written, plain, "preempt-1", 2)
    chat = {"model": TINY_CHAT, "max_tokens": 32, "temperature": 0, "ignore_eos": True}

    async def one_chat(i: int) -> dict:
        body = {**chat, "messages": [{"role": "user", "content": f"Tell me about the number {i}."}]}
        response = await gateway.post("/v1/chat/completions", json=body)
        assert response.status == 200, await response.text()
        return await response.json()

    for wave in range(3):  # chats arrive while batch items hold every slot
        answers = await asyncio.gather(*(one_chat(4 * wave + i) for i in range(4)))
        assert all(a["usage"]["completion_tokens"] == 32 for a in answers)
    job = await asyncio.to_thread(wait_for_job, plain, "preempt-1")
    assert num_preemptions(scheduler) > 0, "no chat took a batch item's slot"
    assert job["status"] == "completed", job
    outputs = read_outputs(plain, "preempt-1")
    assert sorted(o["index"] for o in outputs) == list(range(40)), "every line, exactly once"
    assert int(job["completed"]) == 40 and int(job["failed"]) == 0
    # A preempted line resumed where it was: its answer is the one the same body gets alone.
    by_index = {o["index"]: o["line"] for o in outputs}
    for index in range(40):
        body = by_index[index]["response"]["body"]
        choice = body["choices"][0]
        assert body["usage"]["completion_tokens"] == MAX_TOKENS or choice["finish_reason"] == "stop"
        alone = await gateway.post("/v1/chat/completions", json=json.loads(lines[index])["body"])
        assert alone.status == 200
        assert choice["message"]["content"] == (await alone.json())["choices"][0]["message"]["content"]
