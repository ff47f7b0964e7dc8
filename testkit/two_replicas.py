"""Issue 32, item 1: a healthy two-replica fleet must not fail a request.

    .venv/bin/python -m testkit.two_replicas --runs 20

One redis-server, two `tokenfleet scheduler` processes on it (the default model, SmolLM2,
default flags) and one `tokenfleet gateway`; each run sends 24 concurrent streamed chat
completions through the openai SDK (temperature 0, max_tokens 96, ignore_eos; "Write a numbered
list of K fruits and one fact about each." for K = 3..26). No fault is injected: every stream
must end with finish_reason "length" after 96 tokens. Before the fix, about one run in four had a
stream end in `openai.APIError: invalid: request id '...' is already in use`.

--fresh-fleet starts the processes again for every run (a cold fleet is when steps are longest).
Prints one line per run and the total of failed streams; exits 1 if any stream failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import openai

from shared.net import free_port
from testkit.processes import Children, start_redis, wait_ready
from testkit.runs import log
from workers.default_model import fetch_default_model

NUM_STREAMS = 24
MAX_TOKENS = 96
CLI = [sys.executable, "-m", "tokenfleet.cli"]
# What the schedulers' logs say of the races, counted after each fleet: whether the runs met them.
RACE_EVENTS = ("entry_taken_over", "ownership_lost", "redelivered_request_held", "dead_letter")


@contextmanager
def fleet(model: Path, log_dir: Path):
    """redis-server, two schedulers and a gateway; yields the gateway's URL."""
    children = Children(log_dir)
    try:
        url, _ = start_redis(children, log_dir / "redis")
        for i in range(2):
            children.spawn(f"scheduler-{i}", [*CLI, "scheduler", "--redis-url", url, "--model", str(model),
                                              "--scheduler-id", f"replica-{i}"])
        port = free_port()
        children.spawn("gateway", [*CLI, "gateway", "--redis-url", url, "--model", str(model),
                                   "--port", str(port), "--no-batch-ingester"])
        gateway_url = f"http://127.0.0.1:{port}"
        wait_ready(gateway_url, children, timeout_s=300)
        yield gateway_url
    finally:
        children.stop()
        text = "".join((log_dir / f"scheduler-{i}.log").read_text(errors="replace") for i in range(2))
        log("scheduler logs: " + ", ".join(f"{event} x{text.count(event)}" for event in RACE_EVENTS))


async def _one_stream(sdk: openai.AsyncOpenAI, model: str, num_fruits: int) -> str | None:
    """None if the stream ended as it must; else what went wrong."""
    prompt = f"Write a numbered list of {num_fruits} fruits and one fact about each."
    try:
        stream = await sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=MAX_TOKENS,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        finish, usage = None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
    except openai.OpenAIError as exc:
        return f"K={num_fruits}: {type(exc).__name__}: {exc}"
    if finish != "length" or usage is None or usage.completion_tokens != MAX_TOKENS:
        return f"K={num_fruits}: finish_reason={finish!r}, usage={usage}"
    return None


async def one_run(gateway_url: str, model: str) -> list[str]:
    """The 24 streams at once; the failures."""
    sdk = openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=600)
    try:
        results = await asyncio.gather(*(_one_stream(sdk, model, k) for k in range(3, 3 + NUM_STREAMS)))
    finally:
        await sdk.close()
    return [r for r in results if r is not None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--fresh-fleet", action="store_true", help="new processes for every run")
    args = parser.parse_args()
    os.environ["TOKENFLEET_LOG_LEVEL"] = "INFO"  # (the children's) takeovers are logged at info
    model = fetch_default_model()
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="repro-two-replicas-") as tmp:
        runs_left = args.runs
        while runs_left:
            log_dir = Path(tmp) / f"fleet-{args.runs - runs_left}"
            log_dir.mkdir()
            with fleet(model, log_dir) as gateway_url:
                for _ in range(1 if args.fresh_fleet else runs_left):
                    started = time.monotonic()
                    failed = asyncio.run(one_run(gateway_url, model.name))
                    failures += failed
                    runs_left -= 1
                    log(f"run {args.runs - runs_left}/{args.runs}: {NUM_STREAMS - len(failed)}/{NUM_STREAMS} "
                        f"streams ok, {time.monotonic() - started:.0f} s")
                    for failure in failed:
                        log(f"  failed: {failure}")
    num_streams = args.runs * NUM_STREAMS
    print(f"{args.runs} runs, {num_streams} streams, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
