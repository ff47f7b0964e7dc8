"""bench_batch.py's runs: batch jobs of chat lines on a fleet (one scheduler and one gateway,
each its own process, the ingester inside the gateway), interactive chats' time to first token
beside them, and the in-process engine on the same prompt ids and sampling."""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import redis

from gateway.core.settings import ModelSpec
from gateway.tokens.models import ServedModel
from protocol import registry
from protocol.keys import Keys
from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from testkit.mixed_traffic import submit_job
from testkit.processes import Children, start_gateway, start_scheduler
from testkit.sse import DONE, data_lines
from tokenfleet.redis_server import RedisServer

TOPICS = ["the sea", "a mountain", "autumn", "a city at night", "a robot", "the moon", "bread", "rain"]
INTERACTIVE = ("You are a careful assistant. Read the following notes and answer briefly. Notes: the fleet "
               "serves many users at once; batch jobs fill the idle capacity; interactive users must not "
               "notice them. Each scheduler forms continuous batches over a paged KV cache and preempts "
               "lower-priority work when a more important request arrives. Question {i}: in one sentence, "
               "why should interactive requests preempt batch work?")


def batch_lines(num_lines: int, max_tokens: int) -> list[dict]:
    return [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "SmolLM2-135M-Instruct", "max_tokens": max_tokens, "temperature": 0,
                      "ignore_eos": True,
                      "messages": [{"role": "user", "content": f"Write a short poem about {TOPICS[i % 8]} "
                                                               f"(number {i})."}]}}
            for i in range(num_lines)]


def in_process(model: str, lines: list[dict], args: argparse.Namespace) -> tuple[float, int]:
    served = ServedModel.load(ModelSpec.from_path(model))
    prompts = [served.encode_chat(line["body"]["messages"])[1] for line in lines]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    config = EngineConfig(model=model, dtype=args.dtype, num_kv_blocks=2048, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    with LLMEngine(config) as engine:
        engine.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
    return seconds, sum(len(o.token_ids) for o in outputs)


async def ttft(session: aiohttp.ClientSession, url: str, i: int) -> float:
    body = {"model": "SmolLM2-135M-Instruct", "stream": True, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": INTERACTIVE.format(i=i)}]}
    start = time.perf_counter()
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        first = None
        async for _, data in data_lines(response.content):
            if first is None and data != DONE:
                delta = json.loads(data)["choices"][0]["delta"]
                if delta.get("content"):
                    first = time.perf_counter() - start
    return first


async def ttfts(url: str, count: int, pause_s: float) -> list[float]:
    async with aiohttp.ClientSession() as session:
        values = []
        for i in range(count):
            values.append(await ttft(session, url, i))
            await asyncio.sleep(pause_s)
        return values


def run_job(client: redis.Redis, job_id: str, lines: list[dict]) -> float:
    submit_job(client, job_id, [json.dumps(line) for line in lines])
    return time.perf_counter()


def wait_job(client: redis.Redis, job_id: str, started: float) -> tuple[float, int, int]:
    ended = (b"completed", b"failed", b"cancelled", b"expired")
    while client.hget(Keys().batch_job(job_id), "status") not in ended:
        time.sleep(0.05)
    seconds = time.perf_counter() - started
    status = client.hget(Keys().batch_job(job_id), "status").decode()
    if status != "completed":
        raise SystemExit(f"job {job_id} ended {status}")
    tokens, failed = 0, 0
    for _, fields in client.xrange(Keys().batch_out(job_id)):
        line = json.loads(fields[b"line"])
        if line["response"] and line["response"]["status_code"] == 200:
            tokens += line["response"]["body"]["usage"]["completion_tokens"]
        else:
            failed += 1
    return seconds, tokens, failed


def wait_saturated(client: redis.Redis, max_num_seqs: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for beat in registry.read_live(client, Keys(), [registry.SCHEDULERS])[registry.SCHEDULERS].values():
            if int(beat.get(b"num_running") or 0) >= max_num_seqs:
                return
        time.sleep(0.05)
    raise SystemExit("the batch job never filled the scheduler's sequence slots")


@dataclass
class FleetRun:
    idle: list[float]  # TTFT of each interactive chat, idle fleet
    loaded: list[float]  # the same under the batch job
    alone_s: float  # the job alone: seconds, output tokens
    alone_tokens: int
    shared_s: float  # the job again, beside the interactive chats
    shared_tokens: int


def run_fleet(args: argparse.Namespace, model: str, lines: list[dict]) -> FleetRun:
    """Steps 1 to 3 on a fleet of one scheduler and one gateway (each its own process)."""
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis")
        server.start()
        children = Children(Path(tmp))
        try:
            start_scheduler(children, server.url, model, "--dtype", args.dtype, "--num-kv-blocks", "2048",
                            "--max-num-seqs", str(args.max_num_seqs),
                            "--max-num-batched-tokens", str(args.max_num_batched_tokens))
            url, _ = start_gateway(children, server.url, model)
            client = server.client()
            asyncio.run(ttfts(url, 2, 0.1))  # warm-up
            idle = asyncio.run(ttfts(url, args.interactive, 0.3))
            print(f"idle TTFT: {[round(v * 1000) for v in idle]} ms", flush=True)
            alone_s, alone_tokens, failed = wait_job(client, "alone", run_job(client, "alone", lines))
            print(f"job alone: {alone_s:.1f} s, {alone_tokens} tokens, {failed} failed", flush=True)
            started = run_job(client, "shared", lines)
            wait_saturated(client, args.max_num_seqs)
            loaded = asyncio.run(ttfts(url, args.interactive, 0.3))
            print(f"TTFT under the job: {[round(v * 1000) for v in loaded]} ms", flush=True)
            shared_s, shared_tokens, _ = wait_job(client, "shared", started)
            children.check()
        finally:
            children.stop()
            server.stop()
    return FleetRun(idle, loaded, alone_s, alone_tokens, shared_s, shared_tokens)
