"""Prefix caching: chats sharing one long system prompt, with the cache and without, in one run.

    .venv/bin/python scripts/bench_prefix_cache.py --chats 24        # this CPU (SmolLM2, float32)
    python3 scripts/bench_prefix_cache.py --llama3-8b                # a GPU: Llama-3-8B shape, bf16

Workloads (random.Random(--seed), random token ids clear of the special ids, greedy, EOS
ignored, every request added at once to the in-process engine):
- shared: --chats chats, each one system prompt of 1,000-2,000 tokens (one length drawn for
  the run, the same tokens for every chat) followed by a distinct user turn of 50-200 tokens;
  --max-tokens output tokens each;
- no sharing: the same lengths, every prompt its own tokens: what the cache costs when it
  never hits (hashing every full block, looking it up, keeping it findable).
Each runs on an engine with prefix caching and on one without (`--no-prefix-caching`), built
one after the other with the same settings and warmed up. TTFT is from the moment every request
was added to the step that returned its first token. The table gives the ratios against the
run without caching; --repeats N interleaves N runs of each and reports the medians.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path

from shared.config import EngineConfig
from shared.logging import configure_logging
from shared.model_config import load_model_config
from testkit.prefix_cache_runs import Result, chat_workload, config_dtype, run_engine
from testkit.random_models import LLAMA3_8B, save_random_llama
from testkit.runs import print_command
from workers.default_model import fetch_default_model
from workers.device import resolve_device


def median(results: list[Result], value) -> float:
    return statistics.median(value(r) for r in results)


def print_table(results: dict[bool, dict[str, list[Result]]], caption: str) -> None:
    print(f"\n{caption}\n")
    print("| workload | prefix caching | TTFT p50 | TTFT p99 | output tok/s | cache hits "
          "| TTFT p50 vs off | output tok/s vs off |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in results[False]:
        off, on = results[False][name], results[True][name]
        off_ttft, off_rate = median(off, lambda r: r.ttft_p50), median(off, lambda r: r.run.output_rate)
        for caching, runs in ((False, off), (True, on)):
            ttft, rate = median(runs, lambda r: r.ttft_p50), median(runs, lambda r: r.run.output_rate)
            ratios = ("1.00 (baseline)", "1.00 (baseline)") if not caching else (
                f"{off_ttft / ttft:.2f}x lower", f"{rate / off_rate:.2f}x")
            print(f"| {name} | {'on' if caching else 'off'} | {ttft:.2f} s "
                  f"| {median(runs, lambda r: r.ttft_p99):.2f} s | {rate:.1f} "
                  f"| {median(runs, lambda r: r.hit_rate):.0%} | {ratios[0]} | {ratios[1]} |")
    no_sharing = "no sharing"
    if no_sharing in results[False]:
        off = median(results[False][no_sharing], lambda r: r.run.seconds)
        on = median(results[True][no_sharing], lambda r: r.run.seconds)
        print(f"\nOverhead of the cache when nothing is shared: {on / off - 1:+.1%} wall time "
              f"({on:.1f} s with, {off:.1f} s without)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chats", type=int, default=200, help="chats per workload")
    parser.add_argument("--system-tokens", type=int, nargs=2, default=(1000, 2000), metavar=("MIN", "MAX"),
                        help="the shared system prompt's length is drawn from this range")
    parser.add_argument("--user-tokens", type=int, nargs=2, default=(50, 200), metavar=("MIN", "MAX"))
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per chat")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each workload; medians reported")
    parser.add_argument("--no-sharing", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the workload where no prompt shares a prefix (the overhead)")
    parser.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--llama3-8b", action="store_true",
                        help="a random-weight Llama-3-8B-shaped checkpoint built on the device (GPU)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--max-num-seqs", type=int, help="default: 256")
    parser.add_argument("--max-num-batched-tokens", type=int, help="default: 8192 on cuda, 2048 on cpu")
    parser.add_argument("--num-kv-blocks", type=int, help="default: from memory")
    parser.add_argument("--seconds-limit", type=float, default=1800.0, help="per run")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print_command()
    configure_logging("WARNING")
    device = resolve_device(args.device)
    folder, built = None, False
    try:
        if args.llama3_8b:
            folder, built = save_random_llama(LLAMA3_8B, device).folder, True
        else:
            folder = Path(args.model) if args.model else fetch_default_model()
        vocab_size = load_model_config(str(folder)).vocab_size
        lengths = dict(system_lens=tuple(args.system_tokens), user_lens=tuple(args.user_tokens),
                       max_tokens=args.max_tokens)
        workloads = {"shared system prompt": [
            chat_workload(args.chats, vocab_size, shared=True, seed=args.seed + i, **lengths)
            for i in range(args.repeats)]}
        if args.no_sharing:
            workloads["no sharing"] = [
                chat_workload(args.chats, vocab_size, shared=False, seed=args.seed + i, **lengths)
                for i in range(args.repeats)]
        is_cuda = device.type == "cuda"
        base = dict(model=str(folder), device=args.device, dtype=args.dtype, num_kv_blocks=args.num_kv_blocks,
                    max_num_seqs=args.max_num_seqs or 256,
                    max_num_batched_tokens=args.max_num_batched_tokens or (8192 if is_cuda else 2048),
                    cuda_graph_max_batch_size=args.max_num_seqs or 256)
        results = {}
        for caching in (False, True):
            results[caching] = run_engine(EngineConfig(**base, enable_prefix_caching=caching), workloads,
                                          device, args.seconds_limit)
        shared = workloads["shared system prompt"][0].prompts
        system_len = next(i for i, (a, b) in enumerate(zip(*shared[:2], strict=False)) if a != b)
        name = "Llama-3-8B shape, random weights" if built else Path(folder).name
        user_lens = f"{args.user_tokens[0]}-{args.user_tokens[1]}"
        caption = (f"{args.chats} chats per workload: a {system_len}-token system prompt, user turns of "
                   f"{user_lens} tokens, {args.max_tokens} output tokens each; "
                   f"{name}, {device.type}, {config_dtype(base)}; {args.repeats} run(s) each, medians")
        print_table(results, caption)
    finally:
        if built and folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
