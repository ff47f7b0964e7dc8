"""Prefix-aware routing across replicas: `tokenfleet up --replicas 2` without routing and with it,
one after the other in one run, on the same workload.

    .venv/bin/python scripts/bench_routing.py                # this CPU: SmolLM2, float32

Workload (random.Random(--seed)): --prompts system prompts of --system-words words each (about
as many tokens; the prompt tokens are measured), each with --chats chats of --user-words words,
arriving interleaved (system prompt 0, 1, ... 7, 0, 1, ...) as a Poisson stream of --rate chats
per second; streamed chat completions of --max-tokens tokens (greedy, EOS ignored).

Each replica's KV cache (--num-kv-blocks 160, 16 tokens a block) holds about 4.3 of the 8 system
prompts (~590 tokens, 37 blocks each): the fleet's set of prefixes outgrows one replica's cache,
which is where routing pays. Without routing every replica sees every prompt and evicts most
before they come back; with routing each replica keeps its half. Schedulers run one torch
thread each and steps of at most 256 tokens (TOKENFLEET_NUM_THREADS, _MAX_NUM_BATCHED_TOKENS):
two replicas share a small CPU, and a step of several whole prompts would outlast the heartbeat
(a replica whose heartbeat lapsed is routed nothing, and its peer takes its waiting requests).
Reported, per mode: the fleet-wide prefix-cache hit rate (prompt tokens found in a
cache / looked up, from the schedulers' heartbeats, over this load only), TTFT and end-to-end
latency (tokenfleet/bench.py's client), and each replica's share of the requests with its
routed / stolen / fallback counts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path

from testkit.routing_runs import run_mode, workload
from testkit.runs import log, percentile, print_command
from workers.default_model import fetch_default_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8, help="distinct system prompts")
    parser.add_argument("--chats", type=int, default=16, help="chats per system prompt")
    parser.add_argument("--system-words", type=int, default=560)
    parser.add_argument("--user-words", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rate", type=float, default=1.0, help="chats per second (Poisson)")
    parser.add_argument("--num-kv-blocks", type=int, default=160, help="per replica (16 tokens each)")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="per replica")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="none,prefix", help="the --routing values to run, in order")
    return parser.parse_args()


def print_table(runs: list[dict], args) -> None:
    print(f"\n{args.prompts} system prompts x {args.chats} chats, interleaved, {args.rate}/s Poisson; "
          f"{args.num_kv_blocks} KV blocks and {args.max_num_seqs} sequences per replica; "
          f"max_tokens {args.max_tokens}")
    print("| routing | ok | prompt tokens | hit rate | TTFT p50 ms | TTFT p90 ms | e2e p50 ms | wall s |"
          " replicas: share (routed/stolen/fallback) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for run in runs:
        shares = ", ".join(f"{s} {100 * r['share']:.0f}% ({r['entries_routed']}/{r['entries_stolen']}/"
                           f"{r['entries_fallback']})" for s, r in run["replicas"].items())
        print(f"| {run['mode']} | {run['ok']}/{run['ok'] + run['failed']} | {run['prompt_tokens']} | "
              f"{100 * run['hit_rate']:.1f}% | {1e3 * percentile(run['ttft'], 50):.0f} | "
              f"{1e3 * percentile(run['ttft'], 90):.0f} | {1e3 * percentile(run['e2e'], 50):.0f} | "
              f"{run['wall_s']:.0f} | {shares} |")
    by_mode = {run["mode"]: run for run in runs}
    if {"none", "prefix"} <= set(by_mode):
        none, prefix = by_mode["none"], by_mode["prefix"]
        ratio = prefix["hit_rate"] / none["hit_rate"] if none["hit_rate"] else float("inf")
        print(f"hit rate with routing / without: {ratio:.2f}x; TTFT p50 "
              f"{percentile(none['ttft'], 50) / percentile(prefix['ttft'], 50):.2f}x lower with routing")
    for run in runs:
        for error in run["errors"]:
            print(f"{run['mode']} failed: {error}")


def main() -> int:
    print_command()
    args = parse_args()
    model_dir = fetch_default_model()
    chats = workload(args)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as work:
        for mode in args.modes.split(","):
            runs.append(run_mode(mode, model_dir, chats, args, Path(work)))
            log(f"routing {mode}: hit rate {100 * runs[-1]['hit_rate']:.1f}%")
    print_table(runs, args)
    return 0 if all(run["failed"] == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
