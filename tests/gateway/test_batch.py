"""Batch jobs end to end: a real Redis, real schedulers on a tiny model with SmolLM2's
tokenizer, the gateway's ingester; producers that know nothing of tokenfleet (a plain
`redis` client, the official `openai` client, the CLI)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import pytest_asyncio
import redis

from gateway.app import create_app
from gateway.settings import GatewaySettings, ModelSpec
from tests.gateway.batch_fleet import (
    TINY_CHAT,
    ThreadScheduler,
    job_lines,
    make_tiny_chat_model,
    read_outputs,
    spawn_ingester,
    spawn_scheduler,
    wait_for_job,
)
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_chat(smollm2, tmp_path_factory) -> Path:
    return make_tiny_chat_model(smollm2, tmp_path_factory.mktemp("models") / TINY_CHAT)


@pytest.fixture(scope="module")
def batch_redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def scheduler(batch_redis, tiny_chat):
    scheduler = ThreadScheduler(batch_redis.url, tiny_chat)
    yield scheduler
    scheduler.close()


@pytest.fixture
def plain(batch_redis) -> redis.Redis:
    return redis.Redis.from_url(batch_redis.url)


@pytest.fixture
def gateway_settings(batch_redis, tiny_chat) -> GatewaySettings:
    return GatewaySettings(redis_url=batch_redis.url, models=[ModelSpec.from_path(str(tiny_chat))], poll_s=0.5,
                           batch_lease_s=2.0)


@pytest_asyncio.fixture
async def gateway(gateway_settings, aiohttp_client):
    return await aiohttp_client(create_app(gateway_settings))


def check_exactly_once(outputs: list[dict], num_lines: int, broken: dict[str, str]) -> None:
    """One output per line, each custom_id once; good lines answered, bad ones refused."""
    assert len(outputs) == num_lines, f"{len(outputs)} outputs for {num_lines} lines"
    by_index = {o["index"]: o for o in outputs}
    assert sorted(by_index) == list(range(num_lines)), "every line, exactly once"
    named = [o["custom_id"] for o in outputs if o["custom_id"]]
    assert len(named) == len(set(named)), "a custom_id came back twice"
    unreadable = {cid for cid, kind in broken.items() if kind == "json"}  # cut short: no custom_id to read
    assert set(named) == {f"req-{i}" for i in range(num_lines)} - unreadable
    for o in outputs:
        line = o["line"]
        assert (line["custom_id"] or "") == o["custom_id"]
        cid = f"req-{o['index']}"
        if cid in broken:
            assert not o["ok"], (cid, line)
        else:
            assert o["ok"], (cid, line)
            assert o["custom_id"] == cid
            assert line["response"]["status_code"] == 200
            body = line["response"]["body"]
            assert body["object"] in ("chat.completion", "text_completion")
            assert body["usage"]["completion_tokens"] == 6 or body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.asyncio
async def test_a_1000_line_job_from_a_plain_redis_client_comes_back_exactly_once(scheduler, gateway, plain):
    lines, broken = job_lines(1000)
    entry_id = plain.xadd("tf:batch:in", {"job_id": "plain-1", "lines": "\n".join(lines) + "\n"}).decode()
    job = await asyncio.to_thread(wait_for_job, plain, "plain-1")
    assert job["status"] == "completed", job
    assert plain.get(f"tf:batch:entry:{entry_id}") == b"plain-1"
    assert int(job["total"]) == 1000
    assert int(job["completed"]) + int(job["failed"]) == 1000
    assert int(job["failed"]) == len(broken)
    outputs = read_outputs(plain, "plain-1")
    check_exactly_once(outputs, len(lines), broken)
    # Each malformed line's error names its problem.
    by_index = {o["index"]: o["line"] for o in outputs}
    for cid, kind in broken.items():
        line = by_index[int(cid.split("-")[1])]
        error = line["response"]["body"]["error"]
        word = {"json": "JSON", "url": "url", "field": "frobnicate", "long": "context length",
                "method": "method"}[kind]
        assert word in error["message"] or word == (error["param"] or ""), (kind, error)
        assert line["response"]["status_code"] == 400
    # A greedy line's output is what the REST route answers for the same body.
    line = json.loads(lines[1])
    rest = await gateway.post("/v1/chat/completions", json=line["body"])
    assert rest.status == 200
    batch_body = by_index[1]["response"]["body"]
    assert batch_body["choices"][0]["message"]["content"] == (await rest.json())["choices"][0]["message"]["content"]
    # The job's working keys are gone; nothing is left queued.
    assert not plain.exists("tf:batch:plain-1:lines", "tf:batch:plain-1:written", "tf:res:plain-1.1.0")
    assert not plain.sismember("tf:batch:active", "plain-1")
