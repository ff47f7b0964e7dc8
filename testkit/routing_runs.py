"""bench_routing.py's runs: `tokenfleet up --replicas 2` with one --routing mode, chats sharing
interleaved system prompts streamed at it as a Poisson stream, and the replicas' prefix-cache
and routing counters read from their heartbeats over that load alone."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import aiohttp
import redis

from protocol import registry
from protocol.keys import Keys
from shared.net import free_port
from testkit.processes import Children, wait_ready
from testkit.runs import log
from tokenfleet.bench import Result, one_request, prompt_text

KEYS = Keys()
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_finished", "num_prompt_tokens",
            "entries_routed", "entries_stolen", "entries_fallback")


def workload(args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    systems = [prompt_text(rng, args.system_words) for _ in range(args.prompts)]
    return [{"messages": [{"role": "system", "content": systems[p]},
                          {"role": "user", "content": prompt_text(rng, args.user_words)}]}
            for _ in range(args.chats) for p in range(args.prompts)]


def counters(client: redis.Redis) -> dict[str, dict[str, int]]:
    """scheduler id -> its cumulative counters, from the heartbeats."""
    out = {}
    for name, fields in registry.read_live(client, KEYS, [registry.SCHEDULERS])[registry.SCHEDULERS].items():
        if b"model" in fields:
            out[name] = {c: int(float(fields.get(c.encode(), 0))) for c in COUNTERS}
    return out


async def drive(url: str, model: str, chats: list[dict], args: argparse.Namespace) -> list[Result]:
    rng = random.Random(args.seed + 1)
    arrivals, t = [], 0.0
    for _ in chats:
        arrivals.append(t)
        t += rng.expovariate(args.rate)
    results = [Result(i) for i in range(len(chats))]
    timeout = aiohttp.ClientTimeout(total=None, connect=30, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()

        async def go(i: int) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            body = {"model": model, "stream": True, "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True, **chats[i]}
            await one_request(session, f"{url}/v1/chat/completions", body, results[i])

        await asyncio.gather(*(go(i) for i in range(len(chats))))
    return results


def run_mode(mode: str, model_dir: Path, chats: list[dict], args: argparse.Namespace, work: Path) -> dict:
    home = work / mode
    (home / "logs").mkdir(parents=True)
    os.environ["TOKENFLEET_HOME"] = str(home)
    os.environ.setdefault("TOKENFLEET_NUM_THREADS", "1")  # two replicas on a small CPU
    os.environ.setdefault("TOKENFLEET_MAX_NUM_BATCHED_TOKENS", "256")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    children = Children(home / "logs")
    try:
        children.spawn("up", [sys.executable, "-m", "tokenfleet.cli", "up", "--replicas", "2",
                              "--routing", mode, "--port", str(port), "--model", str(model_dir),
                              "--dtype", "float32",
                              "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs",
                              str(args.max_num_seqs), "--gateway-workers", "1"])
        wait_ready(url, children, timeout_s=600)
        fleet = json.loads((home / "fleet.json").read_text()) if (home / "fleet.json").exists() else {}
        while not fleet:
            children.check()
            time.sleep(0.2)
            fleet = json.loads((home / "fleet.json").read_text()) if (home / "fleet.json").exists() else {}
        client = redis.Redis.from_url(fleet["redis_url"])
        while len(counters(client)) < 2:
            children.check()
            time.sleep(0.2)
        model = fleet["model"]
        warm = [{"messages": [{"role": "user", "content": f"Warm up {i}."}]} for i in range(4)]
        asyncio.run(drive(url, model, warm, argparse.Namespace(**{**vars(args), "rate": 4.0})))
        time.sleep(2.5)  # the warm-up's counts in the heartbeats
        before = counters(client)
        log(f"routing {mode}: {len(chats)} chats at {args.rate}/s")
        started = time.perf_counter()
        results = asyncio.run(drive(url, model, chats, args))
        wall_s = time.perf_counter() - started
        time.sleep(2.5)  # a heartbeat with the last counts
        after = counters(client)
    finally:
        children.stop()
    delta = {s: {c: after[s][c] - before.get(s, {}).get(c, 0) for c in COUNTERS} for s in after}
    ok = [r for r in results if r.ok]
    queries = sum(d["prefix_cache_queries"] for d in delta.values())
    finished = sum(d["num_finished"] for d in delta.values())
    return {
        "mode": mode, "ok": len(ok), "failed": len(results) - len(ok), "wall_s": wall_s,
        "hit_rate": sum(d["prefix_cache_hits"] for d in delta.values()) / queries if queries else 0.0,
        "prompt_tokens": queries, "ttft": [r.first_token - r.started for r in ok],
        "e2e": [r.finished - r.started for r in ok],
        "replicas": {s: {**d, "share": d["num_finished"] / finished if finished else 0.0}
                     for s, d in sorted(delta.items())},
        "errors": sorted({r.error for r in results if not r.ok}),
    }
