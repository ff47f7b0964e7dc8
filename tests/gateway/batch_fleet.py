"""What the batch tests run on: real schedulers on the session's tiny_chat model
(tests/conftest.py; threads, or `tokenfleet scheduler` processes that a test can kill), and job
files in the OpenAI Batch input format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import redis

from protocol.keys import Keys
from tests.fleet_helpers import TINY_CHAT, start_scheduler


def job_lines(num_lines: int, *, max_tokens: int = 6, bad: bool = True,
              chat_only: bool = False) -> tuple[list[str], dict[str, str]]:
    """`num_lines` lines (chat and completions, greedy and seeded; `chat_only`: for a batch whose
    endpoint is chat); with `bad`, some malformed ones among them. Returns the lines and, for each
    bad line's custom_id, what is wrong."""
    lines, broken = [], {}
    for i in range(num_lines):
        custom_id = f"req-{i}"
        if i % 2 or chat_only:
            body = {"model": TINY_CHAT, "messages": [{"role": "user", "content": f"Count to {i}."}],
                    "max_tokens": max_tokens, "temperature": 0}
            url = "/v1/chat/completions"
        else:
            body = {"model": TINY_CHAT, "prompt": f"Line {i}: once upon a time", "max_tokens": max_tokens,
                    "temperature": 0.8, "seed": i}
            url = "/v1/completions"
        line = {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
        if bad and i % 97 == 13:
            kind = ("json", "url", "field", "long", "method")[(i // 97) % 5]
            if chat_only and kind == "url":  # (for a batch with an endpoint, which such a line refuses whole)
                kind = "field"
            broken[custom_id] = kind
            if kind == "json":
                lines.append(json.dumps(line)[:-5])  # cut short
                continue
            if kind == "url":
                line["url"] = "/v1/moderations"
            elif kind == "field":
                body["frobnicate"] = True
            elif kind == "long":
                body["max_tokens"] = 5000  # past the 2,048-token context window
            elif kind == "method":
                line["method"] = "GET"
        lines.append(json.dumps(line))
    return lines, broken


def thread_scheduler(url: str, folder: Path):
    """A real SchedulerService on the tiny chat model, in a thread (close() it)."""
    from tests.gateway.conftest import RealScheduler

    return RealScheduler(url, folder, model_name=TINY_CHAT, scheduler_id="batch-1", num_kv_blocks=1024,
                         max_num_seqs=64, max_num_batched_tokens=2048)


def spawn_scheduler(url: str, folder: Path, scheduler_id: str, *, lease_s: float = 2.0) -> subprocess.Popen:
    """`tokenfleet scheduler` as its own process (so that a test can kill -9 it)."""
    return start_scheduler(url, folder, scheduler_id, "--lease-s", str(lease_s), "--num-kv-blocks", "1024",
                           "--max-num-seqs", "64", "--num-threads", "1")


def spawn_ingester(url: str, folder: Path, *, lease_s: float = 2.0) -> subprocess.Popen:
    argv = [sys.executable, "-m", "tokenfleet.cli", "batch", "ingester", "--redis-url", url, "--model",
            str(folder), "--lease-s", str(lease_s)]
    return subprocess.Popen(argv, cwd=Path(__file__).resolve().parents[2], env={**os.environ},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_for_job(client: redis.Redis, job_id: str, *,
                 statuses=("completed", "failed", "cancelled", "expired"),
                 timeout_s: float = 180.0) -> dict[str, str]:
    """The job's hash once its status is one of `statuses`, read with a plain Redis client."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = {k.decode(): v.decode() for k, v in client.hgetall(Keys().batch_job(job_id)).items()}
        if job.get("status") in statuses:
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still {job.get('status')!r} after {timeout_s} s: {job}")


def read_outputs(client: redis.Redis, job_id: str) -> list[dict]:
    """Every output entry of a job, as {custom_id, ok, line (parsed)}, with a plain client."""
    entries = client.xrange(Keys().batch_out(job_id))
    return [{"custom_id": f[b"custom_id"].decode(), "ok": f[b"ok"] == b"1", "index": int(f[b"index"]),
             "line": json.loads(f[b"line"])} for _, f in entries]


def num_written(client: redis.Redis, job_id: str) -> int:
    return client.xlen(Keys().batch_out(job_id))


def wait_written(client: redis.Redis, job_id: str, at_least: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while num_written(client, job_id) < at_least:
        if time.monotonic() > deadline:
            written = num_written(client, job_id)
            raise AssertionError(f"job {job_id}: {written} lines written, wanted {at_least}")
        time.sleep(0.05)
