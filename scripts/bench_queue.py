"""Queue path versus in-process: the same requests through Redis and one scheduler, and
through the in-process engine, in one run. Run by hand (not a test):

    .venv/bin/python scripts/bench_queue.py [--num-requests 64] [--dtype float32]

Workload (random.Random(0)): prompts of 32-256 random token ids, 32-128 output tokens,
greedy, EOS ignored, SmolLM2-135M-Instruct. The queue path runs `tokenfleet scheduler` as its own
process (as deployed) and is timed from the first XADD to the last terminal state in
tf:res; the in-process path is timed around `generate`; both engines are loaded and warm
before timing. Goal: queue throughput >= 0.9 of in-process.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler.engine import LLMEngine  # noqa: E402
from shared.config import EngineConfig  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from tests.scheduler.service_client import TERMINAL, submit, token_ids, wait_terminal  # noqa: E402
from tokenfleet.redis_server import RedisServer  # noqa: E402
from workers.default_model import fetch_default_model  # noqa: E402


def _wait_done(client, ids: list[str]) -> None:
    """Poll only the state field, rarely: the waiting must not steal the scheduler's cores."""
    pending = list(ids)
    while pending:
        time.sleep(0.25)
        pipe = client.pipeline()
        for req_id in pending:
            pipe.hget(f"tf:res:{req_id}", "state")
        states = pipe.execute()
        pending = [r for r, s in zip(pending, states, strict=True) if s not in TERMINAL]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    print("command:", " ".join(sys.argv))
    model = str(fetch_default_model())
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(32, 256))]
               for _ in range(args.num_requests)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(32, 128), ignore_eos=True)
              for _ in prompts]
    num_output = sum(p.max_tokens for p in params)
    config = EngineConfig(model=model, dtype=args.dtype, num_kv_blocks=2048)

    with LLMEngine(config) as engine:
        engine.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
        start = time.perf_counter()
        direct = engine.generate(prompts, params)
        in_process_s = time.perf_counter() - start

    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis")
        server.start()
        # The scheduler as deployed: its own process, its loop on the main thread.
        scheduler = subprocess.Popen(
            [sys.executable, "-m", "tokenfleet.cli", "scheduler", "--redis-url", server.url, "--model", model,
             "--model-name", "smol", "--scheduler-id", "bench", "--dtype", args.dtype,
             "--num-kv-blocks", "2048"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = server.client()
        try:
            while not client.exists("tf:sched:bench"):  # loaded and looping
                if scheduler.poll() is not None:
                    raise SystemExit(f"the scheduler exited with {scheduler.returncode}")
                time.sleep(0.2)
            warmup = [submit(client, "smol", p, SamplingParams(temperature=0.0, max_tokens=2))
                      for p in prompts[:2]]
            _wait_done(client, warmup)
            start = time.perf_counter()
            ids = [submit(client, "smol", p, sp) for p, sp in zip(prompts, params, strict=True)]
            _wait_done(client, ids)
            queue_s = time.perf_counter() - start
            records = wait_terminal(client, ids, timeout_s=60)
        finally:
            scheduler.terminate()
            scheduler.wait(timeout=60)
            server.stop()
    same = all(token_ids(records[i]) == r.token_ids for i, r in zip(ids, direct, strict=True))
    print(f"\n| path ({args.num_requests} requests, {num_output} output tokens, {args.dtype}) "
          "| seconds | output tok/s |")
    print("| --- | --- | --- |")
    print(f"| in-process engine (baseline) | {in_process_s:.1f} | {num_output / in_process_s:.1f} |")
    print(f"| Redis stream -> scheduler -> tf:res | {queue_s:.1f} | {num_output / queue_s:.1f} |")
    print(f"| queue / in-process | | {in_process_s / queue_s:.2f} |")
    print(f"\nsame tokens on both paths: {same}")


if __name__ == "__main__":
    main()
