"""The gateway's time to queue a chat (issue 27's TTFT): from the client's POST to the request's
XADD, on CPU, through a real `tokenfleet gateway` process on a real Redis, no scheduler (a
heartbeat hash stands in for one). Prints the end-to-end percentiles and each step's cost
timed alone in a gateway app of this process, a tenant's too (testkit/queue_latency.py says how):

    .venv/bin/python scripts/bench_queue_latency.py [--requests 300] [--system-words 800] [--smoke]

The chats: one shared system prompt of --system-words words, a user turn of 40-300 words each,
streamed /v1/chat/completions, SmolLM2's tokenizer and chat template (a tiny random llama).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import redis

from gateway.core.settings import GatewaySettings, ModelSpec
from gateway.tenants.directory import Tenant, TenantLimits
from protocol.keys import Keys
from testkit.checkpoints import tiny_llama_with_smollm2_tokenizer
from testkit.processes import Children, start_gateway
from testkit.queue_latency import EntryListener, chat_bodies, fake_heartbeat, post_chats, step_times
from testkit.runs import percentile, print_command
from tokenfleet.redis_server import RedisServer

MODEL = "tiny"


def row(name: str, values: list[float]) -> str:
    return f"| {name} | " + " | ".join(f"{percentile(values, q) * 1e3:.3f}" for q in (50, 90, 99)) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--system-words", type=int, default=800)
    parser.add_argument("--interval-ms", type=float, default=10.0, help="answer to next POST")
    parser.add_argument("--smoke", action="store_true", help="40 requests")
    parser.add_argument("--profile-gateway", metavar="FILE", help="run the gateway under cProfile")
    args = parser.parse_args()
    num = 40 if args.smoke else args.requests
    print_command()
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_llama_with_smollm2_tokenizer(Path(tmp) / MODEL, max_position_embeddings=8192)
        # Redis's append-only file in memory when it can: its fsync (one per write) on this
        # machine's shared disk would be what is measured, not the gateway.
        shm = Path("/dev/shm")
        server = RedisServer((shm if shm.is_dir() else Path(tmp)) / f"{Path(tmp).name}-redis")
        server.start()
        children = Children(Path(tmp) / "logs")
        try:
            keys = Keys()
            fake_heartbeat(redis.Redis.from_url(server.url), keys, MODEL)
            bodies = chat_bodies(MODEL, num + 10, system_words=args.system_words)
            profile = ("-m", "cProfile", "-o", str(Path(args.profile_gateway).resolve())) \
                if args.profile_gateway else ()
            url, _ = start_gateway(children, server.url, folder, "--model-name", MODEL, python_flags=profile)
            stream = keys.request_stream(MODEL, "interactive")
            with EntryListener(server.port, stream, Path(tmp) / "entries.pickle") as listener:
                asyncio.run(post_chats(url, bodies[:10], args.interval_ms / 1e3))  # warm-up
                posted = asyncio.run(post_chats(url, bodies[10:], args.interval_ms / 1e3))
            entries = listener.entries()
            children.stop()
            settings = GatewaySettings(redis_url=server.url, models=[ModelSpec(str(folder), MODEL)])
            steps = asyncio.run(step_times(settings, bodies))
            limits = TenantLimits(requests_per_minute=10**6, tokens_per_minute=10**9,
                                  max_concurrent_requests=10**4)
            tenanted = asyncio.run(step_times(settings, bodies, Tenant("bench", limits)))
        finally:
            children.stop()
            server.stop()
            shutil.rmtree(server.data_dir, ignore_errors=True)
    missing = [r for r in posted if r not in entries]
    if missing:
        raise SystemExit(f"{len(missing)} of {len(posted)} requests never reached the stream")
    print(f"\n{num} chats, a {args.system_words}-word shared system prompt, one at a time (ms)\n")
    print("| step | p50 | p90 | p99 |\n| --- | ---: | ---: | ---: |")
    print(row("POST -> XADD (gateway process, end to end)", [entries[r] - posted[r] for r in posted]))
    for name, values in steps.items():
        print(row(f"{name} (in process)", values[10:]))
    for name, values in tenanted.items():  # every limit of a tenant: requests, tokens, concurrency
        print(row(f"{name} (in process, a tenant's)", values[10:]))


if __name__ == "__main__":
    main()
