"""Queue path versus in-process: the same requests through Redis and one scheduler, and
through the in-process engine, in one run. Run by hand (not a test):

    .venv/bin/python scripts/bench_queue.py [--num-requests 64] [--dtype float32]

Workload (random.Random(0)): prompts of 32-256 random token ids, 32-128 output tokens,
greedy, EOS ignored, SmolLM2-135M-Instruct. The queue path runs `tokenfleet scheduler` as its own
process (as deployed); every request is XADDed in one pipeline, and the path is timed from it
until the request stream is empty (a scheduler deletes an entry when it writes its terminal
state in tf:res). The in-process path is timed around `generate`; both engines are loaded and
warm before timing. Goal: queue throughput >= 0.9 of in-process.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path

from protocol.messages import unpack_list_chunks
from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from testkit.processes import Children, start_scheduler
from testkit.redis_queue import read_results, submit_requests, wait_drained
from testkit.runs import print_command
from testkit.workloads import greedy, uniform_workload
from tokenfleet.redis_server import RedisServer
from workers.default_model import fetch_default_model

MODEL_NAME = "smol"
SCHEDULER_ID = "bench"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    print_command()
    model = str(fetch_default_model())
    workload = uniform_workload(args.num_requests, 49152, prompt_lens=(32, 256), output_lens=(32, 128))
    params = [greedy(m) for m in workload.max_tokens]
    config = EngineConfig(model=model, dtype=args.dtype, num_kv_blocks=2048)

    with LLMEngine(config) as engine:
        engine.generate(workload.prompts[:2], greedy(2))  # warm-up
        start = time.perf_counter()
        direct = engine.generate(workload.prompts, params)
        in_process_s = time.perf_counter() - start

    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis")
        server.start()
        children = Children(Path(tmp))
        try:
            # As deployed: its own process, its loop on the main thread; timed once it is looping.
            start_scheduler(children, server.url, model, "--model-name", MODEL_NAME, "--dtype", args.dtype,
                            "--num-kv-blocks", "2048", scheduler_id=SCHEDULER_ID)
            client = server.client()
            submit_requests(client, MODEL_NAME, workload.prompts[:2], [greedy(2)] * 2)  # warm-up
            wait_drained(client, MODEL_NAME, 300, children=children, poll_s=0.25)
            # Polled rarely: the waiting must not steal the scheduler's cores.
            ids, start = submit_requests(client, MODEL_NAME, workload.prompts, params)
            wait_drained(client, MODEL_NAME, 600, children=children, poll_s=0.25)
            queue_s = time.monotonic() - start
            records = read_results(client, ids)
        finally:
            children.stop()
            server.stop()
    same = all(unpack_list_chunks(records[i].get(b"token_ids", b"")) == r.token_ids
               for i, r in zip(ids, direct, strict=True))
    num_output = workload.num_output_tokens
    print(f"\n| path ({args.num_requests} requests, {num_output} output tokens, {args.dtype}) "
          "| seconds | output tok/s |")
    print("| --- | --- | --- |")
    print(f"| in-process engine (baseline) | {in_process_s:.1f} | {num_output / in_process_s:.1f} |")
    print(f"| Redis stream -> scheduler -> tf:res | {queue_s:.1f} | {num_output / queue_s:.1f} |")
    print(f"| queue / in-process | | {in_process_s / queue_s:.2f} |")
    print(f"\nsame tokens on both paths: {same}")


if __name__ == "__main__":
    main()
