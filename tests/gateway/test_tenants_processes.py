"""Tenant limits hold across gateway processes: two `tokenfleet gateway` processes on one Redis
(started with a password, given to the gateways in --redis-password-file) share the counters."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from protocol.keys import Keys
from shared.net import free_port
from tests.gateway.conftest import MODEL
from tests.gateway.fake_scheduler import FakeScheduler
from tokenfleet.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[2]
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
PASSWORD = "s3cret pass:word"


def _gateway(redis_url: str, password_file: Path, tenants_file: Path, model: Path,
             port: int) -> subprocess.Popen:
    env = {**os.environ, "TOKENFLEET_LOG_LEVEL": "WARNING"}
    return subprocess.Popen(
        [sys.executable, "-m", "tokenfleet.cli", "gateway", "--redis-url", redis_url, "--redis-password-file",
         str(password_file), "--tenants-file", str(tenants_file), "--port", str(port), "--model", str(model),
         "--no-batch-ingester"], cwd=REPO, env=env, start_new_session=True)


async def _wait_ready(session: aiohttp.ClientSession, base: str, process: subprocess.Popen) -> None:
    for _ in range(1800):
        assert process.poll() is None, f"the gateway exited with {process.returncode}"
        try:
            async with session.get(f"{base}/ready") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"{base} never became ready")


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict, dict]:
    async with session.post(url, json=body, headers={"Authorization": "Bearer key-a"}) as response:
        return response.status, dict(response.headers), await response.json()


@pytest.mark.slow
@pytest.mark.asyncio
async def test_limits_hold_across_two_gateway_processes_on_a_password_protected_redis(
        tmp_path, smollm2, tokenizer):
    redis_server = RedisServer(tmp_path / "redis", password=PASSWORD)
    redis_server.start()
    password_file = tmp_path / "redis-password"
    password_file.write_text(PASSWORD + "\n")
    tenants_file = tmp_path / "tenants.json"
    tenants_file.write_text(json.dumps({"tenants": {"team-a": {
        "keys": ["key-a"], "requests_per_minute": 6, "max_concurrent_requests": 2}}}))
    plain_url = f"redis://127.0.0.1:{redis_server.port}/0"  # no password: that comes from the file
    ports = [free_port(), free_port()]
    gateways = [_gateway(plain_url, password_file, tenants_file, smollm2, port) for port in ports]
    bases = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        with FakeScheduler(redis_server.url, MODEL, tokenizer, token_delay_s=0.05) as fake:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                for base, process in zip(bases, gateways, strict=True):
                    await _wait_ready(session, base, process)
                # Concurrency: one slow request through each gateway; a third, through either, is refused.
                slow = {**CHAT, "max_tokens": 60, "kind": "chat"}
                assert (await _post(session, f"{bases[0]}/v1/requests", slow))[0] == 202
                assert (await _post(session, f"{bases[1]}/v1/requests", slow))[0] == 202
                third = CHAT | {"kind": "chat"}
                status, headers, body = await _post(session, f"{bases[0]}/v1/requests", third)
                assert status == 429 and body["error"]["code"] == "max_concurrent_requests"
                assert headers["Retry-After"] == "1"
                for _ in range(600):  # the scheduler ends them, and their leases
                    if fake.client.zcard(Keys().tenant_leases("team-a")) == 0:
                        break
                    await asyncio.sleep(0.05)
                assert fake.client.zcard(Keys().tenant_leases("team-a")) == 0
                # Requests per minute: 6 in all (2 used above, 1 refused call used none), shared.
                statuses = [(await _post(session, f"{bases[i % 2]}/v1/chat/completions", CHAT))
                            for i in range(5)]
        codes = [status for status, _, _ in statuses]
        assert codes == [200, 200, 200, 200, 429]
        status, headers, body = statuses[-1]
        assert body["error"]["code"] == "requests_per_minute" and int(headers["Retry-After"]) >= 1
    finally:
        for process in gateways:
            process.terminate()
        for process in gateways:
            process.wait(timeout=30)
        redis_server.stop()
