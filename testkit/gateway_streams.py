"""bench_gateway.py's run: a real Redis, one `tokenfleet scheduler` and one `tokenfleet gateway`
(each its own process) over a tiny llama with SmolLM2's tokenizer, a listener process
timestamping every token event on Redis, and --streams streaming chat clients in this process;
the gateway's memory and CPU time around them, and each chunk matched to its event."""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from testkit.added_latency import latencies
from testkit.chat_streams import Counter, Stream, check_stream, run_clients
from testkit.checkpoints import tiny_llama_with_smollm2_tokenizer
from testkit.processes import Children, RssSampler, start_gateway, start_scheduler
from testkit.redis_queue import EventListener
from testkit.runs import raise_fd_limit
from tokenfleet.redis_server import RedisServer

MODEL_NAME = "tiny"
PROMPT_TOKENS_BOUND = 64  # the chat-templated prompts below stay under this many tokens


@dataclass
class GatewayRun:
    errors: list[Stream]  # the streams that failed a check
    max_open: int  # streams held open at once
    rss_before: float  # the gateway's, bytes
    rss_peak: float
    user_s: float  # the gateway's CPU time over the streams
    sys_s: float
    wall_s: float
    client_gaps: list[float]  # seconds between a stream's chunks at the client
    step_gaps: list[float]  # between a request's events at the listener
    added_itl: list[float]  # client gap - listener gap, per chunk
    added: list[float]  # client arrival - listener arrival, per chunk
    matched: int  # chunks matched to listener events
    unmatched: int
    hwm_reset: bool  # the peak RSS from VmHWM too


def run(args: argparse.Namespace, tmp: Path, children: Children) -> GatewayRun:
    raise_fd_limit(4 * args.streams + 256)  # children inherit it: the gateway holds every stream too
    model = tiny_llama_with_smollm2_tokenizer(tmp / "tiny")
    redis_server = RedisServer(tmp / "redis")
    redis_server.start()
    try:
        return _run_with_redis(args, tmp, children, model, redis_server)
    finally:
        # A second Ctrl-C (or SIGTERM) must not cut the cleanup short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        children.stop()
        try:
            redis_server.stop()
        except subprocess.TimeoutExpired:
            redis_server.process.kill()
            redis_server.process.wait(timeout=5)


def _run_with_redis(args: argparse.Namespace, tmp: Path, children: Children, model: Path,
                    redis_server: RedisServer) -> GatewayRun:
    blocks_per_seq = math.ceil((PROMPT_TOKENS_BOUND + args.max_tokens) / 16) + 1
    num_kv_blocks = args.streams * blocks_per_seq + 64
    sched_flags = ["--model-name", MODEL_NAME, "--dtype", "float32",
                   "--max-num-seqs", str(max(args.streams, 8)), "--max-num-batched-tokens", "4096",
                   "--num-kv-blocks", str(num_kv_blocks)]
    if args.scheduler_threads:
        sched_flags += ["--num-threads", str(args.scheduler_threads)]
    start_scheduler(children, redis_server.url, model, *sched_flags)
    profile = ()
    if args.profile_gateway:
        profile = ("-m", "cProfile", "-o", str(Path(args.profile_gateway).resolve()))
    base, gateway_pid = start_gateway(children, redis_server.url, model, "--model-name", MODEL_NAME,
                                      "--max-queue", "0", port=args.port or None, python_flags=profile)
    url = f"{base}/v1/chat/completions"

    # Warm-up: the first requests pay for imports, the chat template's compilation, pools.
    counter = Counter()
    warm, _ = asyncio.run(run_clients(url, MODEL_NAME, args.warmup_streams, 8, 0.0, counter))
    for s in warm:
        check_stream(s, 8)
    if any(s.error for s in warm):
        raise RuntimeError(f"warm-up failed: {[s.error for s in warm if s.error][:3]}\n"
                           f"{children.tail('gateway')}\n{children.tail('scheduler')}")
    time.sleep(1.0)

    with EventListener(redis_server.port, tmp / "listener.pickle") as listener:
        sampler = RssSampler(gateway_pid)
        before = statistics.median(sampler.rss() for _ in range(5))
        cpu_before = sampler.proc.cpu_times()
        sampler.reset_hwm()
        sampler.start()
        counter = Counter()
        streams, wall_s = asyncio.run(run_clients(url, MODEL_NAME, args.streams, args.max_tokens, args.ramp_s,
                                                  counter))
        peak = sampler.finish()
        cpu_after = sampler.proc.cpu_times()
        children.check()
        time.sleep(0.5)  # the listener has every event by now
    events = listener.events()

    for s in streams:
        check_stream(s, args.max_tokens)
    errors = [s for s in streams if s.error is not None]
    client_gaps, step_gaps, added_itl, added, matched, unmatched = latencies(streams, events)
    return GatewayRun(errors, counter.max_open, before, peak, cpu_after.user - cpu_before.user,
                      cpu_after.system - cpu_before.system, wall_s, client_gaps, step_gaps, added_itl, added,
                      matched, unmatched, sampler.hwm_reset)
