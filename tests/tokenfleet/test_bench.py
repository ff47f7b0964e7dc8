"""`tokenfleet bench` against a real gateway (and the fake scheduler behind it), as a user runs it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gateway.conftest import MODEL

pytestmark = pytest.mark.asyncio
REPO = Path(__file__).resolve().parents[2]


async def bench(*flags: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "tokenfleet.cli", "bench", *flags]
    return await asyncio.to_thread(subprocess.run, argv, cwd=REPO, capture_output=True, text=True,
                                   timeout=120)


async def test_bench_streams_every_request_and_reports_latencies(make_client, fake_scheduler):
    client = await make_client()
    url = str(client.make_url("")).rstrip("/")
    done = await bench("--url", url, "--num-requests", "12", "--concurrency", "4", "--max-tokens", "8",
                       "--rate", "50", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["model"] == MODEL  # found through /v1/models
    assert (summary["ok"], summary["failed"], summary["errors"]) == (12, 0, {})
    assert summary["output_tokens"] == 12 * 8
    for name in ("ttft_ms", "itl_ms", "e2e_ms"):
        assert summary[name]["p50"] is not None and summary[name]["p50"] >= 0, summary
    assert summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]
    assert len(fake_scheduler.seen) == 12
    assert all(m.sampling_params().max_tokens == 8 and m.sampling_params().ignore_eos
               for m in fake_scheduler.seen)
    table = await bench("--url", url, "--num-requests", "2", "--completions")
    assert table.returncode == 0 and "| TTFT |" in table.stdout and "2/2 requests" in table.stdout


async def test_bench_reports_failures_and_exits_non_zero(make_client, fake_scheduler):
    client = await make_client()
    url = str(client.make_url("")).rstrip("/")
    done = await bench("--url", url, "--num-requests", "3", "--model", "no-such-model", "--json")
    assert done.returncode == 1
    summary = json.loads(done.stdout)
    assert summary["failed"] == 3
    [(error, count)] = summary["errors"].items()
    assert count == 3 and "HTTP 404" in error and "no-such-model" in error
