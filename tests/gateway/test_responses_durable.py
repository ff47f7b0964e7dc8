"""A background response outlives the processes that served it: kill -9 the gateway that
created it (while it streamed the response's events to its client) and the scheduler running
it; through another gateway, the response completes with the undisturbed greedy text, and the
client's stream, resumed there with starting_after, has no gap and no repeat."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from protocol.keys import Keys
from shared.net import free_port
from tests.fleet_helpers import start_scheduler, stop_schedulers, wait_heartbeat

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]
REPO = Path(__file__).resolve().parents[2]
KEYS = Keys()
MODEL = "smol"
BODY = {"model": MODEL, "input": "Count from 1 to 100, separated by commas.", "max_output_tokens": 48,
        "temperature": 0}


def _gateway(redis_url: str, model: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "TOKENFLEET_LOG_LEVEL": "WARNING"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return subprocess.Popen([sys.executable, "-m", "tokenfleet.cli", "gateway", "--redis-url", redis_url,
                             "--port", str(port), "--model", str(model), "--model-name", MODEL,
                             "--workers", "1"], cwd=REPO, env=env, start_new_session=True)


def _scheduler(url: str, model: Path, name: str) -> subprocess.Popen:
    return start_scheduler(url, model, name, "--lease-s", "2", "--num-kv-blocks", "256", model_name=MODEL)


async def _wait_ready(base: str, process: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            assert process.poll() is None, f"the gateway exited with {process.returncode}"
            assert time.monotonic() < deadline, "the gateway never got ready"
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{base}/ready") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.2)


async def _events(response: aiohttp.ClientResponse, into: list[dict]) -> None:
    """Read SSE data lines into `into` until the stream ends or breaks."""
    with contextlib.suppress(aiohttp.ClientError, asyncio.IncompleteReadError):
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                into.append(json.loads(line[6:]))


def _kill(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def _deltas(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


async def test_a_background_response_survives_its_gateway_and_its_scheduler(redis_server, smollm2):
    client = redis_server.client()
    port_a, port_b = free_port(), free_port()
    base_a, base_b = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
    victim = _scheduler(redis_server.url, smollm2, "victim")
    gateway_a = _gateway(redis_server.url, smollm2, port_a)
    gateway_b = _gateway(redis_server.url, smollm2, port_b)
    survivor = None
    try:
        wait_heartbeat(client, "victim", victim)
        await _wait_ready(base_a, gateway_a)
        await _wait_ready(base_b, gateway_b)
        async with aiohttp.ClientSession() as session:
            # The undisturbed greedy text, through the same path (not stored).
            async with session.post(f"{base_b}/v1/responses", json={**BODY, "store": False}) as response:
                undisturbed = (await response.json())["output"][0]["content"][0]["text"]
            assert len(undisturbed) > 40

            seen: list[dict] = []
            response = await session.post(f"{base_a}/v1/responses",
                                           json={**BODY, "background": True, "stream": True})
            assert response.status == 200
            reader = asyncio.ensure_future(_events(response, seen))
            while sum(e["type"] == "response.output_text.delta" for e in seen) < 3:
                assert not reader.done(), seen
                await asyncio.sleep(0.01)
            req_id = seen[0]["response"]["id"].removeprefix("resp_")
            _kill(victim)  # mid-generation
            _kill(gateway_a)  # the client's stream breaks
            await asyncio.wait_for(reader, 30)
            response.close()
            record = client.hgetall(KEYS.result(req_id))
            assert record[b"state"] == b"running", record.get(b"state")
            last = seen[-1]["sequence_number"]
            assert [e["sequence_number"] for e in seen] == list(range(last + 1))

            survivor = _scheduler(redis_server.url, smollm2, "survivor")
            rest: list[dict] = []
            async with session.get(f"{base_b}/v1/responses/resp_{req_id}",
                                   params={"stream": "true", "starting_after": str(last)}) as resumed:
                assert resumed.status == 200
                await _events(resumed, rest)
            async with session.get(f"{base_b}/v1/responses/resp_{req_id}") as got:
                stored = await got.json()
    finally:
        for process in (gateway_a, gateway_b):
            _kill(process)
        stop_schedulers(victim, survivor)
    assert client.hget(KEYS.result(req_id), "scheduler") == b"survivor"
    numbers = [e["sequence_number"] for e in seen + rest]
    assert numbers == list(range(len(numbers)))  # no gap, no repeat
    assert rest[-1]["type"] in ("response.completed", "response.incomplete")
    assert _deltas(seen) + _deltas(rest) == undisturbed
    assert stored["status"] == rest[-1]["response"]["status"]
    assert stored["output"][0]["content"][0]["text"] == undisturbed
    assert stored == rest[-1]["response"]
