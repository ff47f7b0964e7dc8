"""`tokenfleet gateway --workers 2`: two gateway processes on one port, both serving (each
/health names its pid), streams through either, /metrics summing both, a worker killed is
replaced, and SIGTERM -- or the parent killed outright -- leaves no process behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil
import pytest

from shared.net import free_port
from testkit.sse import DONE, data_fields
from tests.gateway.conftest import MODEL
from tests.gateway.fake_scheduler import FakeScheduler
from tokenfleet.cli import build_parser
from tokenfleet.up import default_gateway_workers

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0


def _start(redis_url: str, model: Path, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "TOKENFLEET_LOG_LEVEL": "WARNING", "TOKENFLEET_WORKERS": "2"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return subprocess.Popen([sys.executable, "-m", "tokenfleet.cli", "gateway", "--redis-url", redis_url,
                             "--port", str(port), "--model", str(model), *extra], cwd=REPO, env=env,
                            start_new_session=True)


async def _pids(base: str, want: int, parent: subprocess.Popen, exclude: set[int] = frozenset()) -> set[int]:
    """Pids answering /health (a new connection each time), until `want` of them beyond `exclude`."""
    seen: set[int] = set()
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(seen - exclude) < want:
        assert parent.poll() is None, f"the gateway exited with {parent.returncode}"
        assert time.monotonic() < deadline, f"only saw pids {seen}"
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                async with session.get(f"{base}/health") as response:
                    seen.add((await response.json())["pid"])
        except aiohttp.ClientError:
            await asyncio.sleep(0.2)
    return seen - exclude


def _workers(parent: subprocess.Popen) -> set[int]:
    commands = {child.pid: " ".join(child.cmdline()) for child in psutil.Process(parent.pid).children()}
    return {pid for pid, command in commands.items() if "spawn_main" in command}


def _gone(pids: set[int], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if psutil.pid_exists(pid)
                 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


async def _stream(base: str) -> tuple[str, int]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        async with session.post(f"{base}/v1/chat/completions", json=body) as response:
            assert response.status == 200
            text = await response.text()
    lines = data_fields(text)  # past any id: line
    assert lines[-1] == DONE
    return "".join(json.loads(c)["choices"][0]["delta"].get("content", "") for c in lines[:-1]), len(lines)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_two_workers_serve_on_one_port_and_stop_cleanly(redis_server, smollm2, tokenizer):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    gateway = _start(redis_server.url, smollm2, port)
    try:
        first = await _pids(base, 2, gateway)
        assert first == _workers(gateway)  # the parent serves nothing itself
        with FakeScheduler(redis_server.url, MODEL, tokenizer):
            results = await asyncio.gather(*(_stream(base) for _ in range(8)))
        assert {text for text, _ in results} == {results[0][0]} and results[0][0].startswith("The quick")
        async with aiohttp.ClientSession() as session:
            metrics = await (await session.get(f"{base}/metrics")).text()
        served = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith("tokenfleet_gateway_http_requests_total{")
                     and 'route="/v1/chat/completions"' in line)
        assert served == 8  # both workers' streams, whichever answered /metrics

        victim = next(iter(first))
        os.kill(victim, signal.SIGKILL)
        replacement = await _pids(base, 1, gateway, exclude=first)  # the parent starts another
        workers = _workers(gateway)
        assert victim not in workers and replacement <= workers and len(workers) == 2

        os.kill(gateway.pid, signal.SIGTERM)
        assert gateway.wait(timeout=60) == 0
        assert _gone(workers | first), "a gateway worker outlived the parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(gateway.pid, signal.SIGKILL)
        gateway.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_workers_do_not_outlive_a_parent_killed_outright(redis_server, smollm2):
    port = free_port()
    gateway = _start(redis_server.url, smollm2, port, "--workers", "2")
    try:
        workers = await _pids(f"http://127.0.0.1:{port}", 2, gateway)
        os.kill(gateway.pid, signal.SIGKILL)  # no chance to stop them: the kernel tells them
        gateway.wait(timeout=10)
        assert _gone(workers), "orphaned gateway workers"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(gateway.pid, signal.SIGKILL)


@pytest.mark.slow
def test_workers_refuse_a_port_another_process_holds(redis_server, smollm2):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        gateway = _start(redis_server.url, smollm2, holder.getsockname()[1])
        gateway.wait(timeout=60)
    assert gateway.returncode == 1  # rather than sharing it through SO_REUSEPORT


def test_worker_counts_come_from_flags_the_environment_or_the_cores(monkeypatch):
    assert [default_gateway_workers(n) for n in (1, 2, 4, 8, 16, 32, 64, 256)] == [1, 1, 1, 2, 4, 8, 8, 8]
    assert build_parser().parse_args(["gateway"]).workers == 1
    assert build_parser().parse_args(["up"]).gateway_workers is None  # then: from the cores
    monkeypatch.setenv("TOKENFLEET_WORKERS", "3")
    monkeypatch.setenv("TOKENFLEET_GATEWAY_WORKERS", "5")
    assert build_parser().parse_args(["gateway"]).workers == 3
    assert build_parser().parse_args(["gateway", "--workers", "2"]).workers == 2
    assert build_parser().parse_args(["up"]).gateway_workers == 5
