"""The host KV tier on one GPU, in one run: multi-turn conversations whose working set is about 3x
the GPU's KV pool (and below GPU + host), with and without the tier; the same within the GPU pool
(what the tier costs when nothing comes back from it); the host tier's copy rates.

    python3 scripts/bench_kv_offload_gpu.py                 # H100/H200: Llama-3-8B shape, bf16
    python3 scripts/bench_kv_offload_gpu.py --think-seconds 0   # closed loop: what the tier costs
    python3 scripts/bench_kv_offload_gpu.py --smoke --device cpu --dtype float32   # checks the script

A random-weight Llama-3-8B-shaped checkpoint in process (the engine `tokenfleet generate` runs),
its GPU pool cut to --num-kv-blocks (default 2,048 blocks of 16 tokens: 32k tokens, 4 GiB) so that
the working set fits the card's host memory. Two engines, one after the other: without the tier,
then with --kv-offloading-size GiB, each with the device's defaults (async scheduling on CUDA;
--no-async-scheduling for the engine that submits a step once the last is back). Each runs
(testkit/multiturn_runs.py) conversations sharing a --system-tokens system prompt, of --turns turns
of --user-tokens each and replies of --max-tokens, arriving at --rate per second, each turn sent
--think-seconds (mean) after the reply before it (a list runs the beyond case once per value):
first --within conversations (their histories fit the GPU pool), then --beyond of them (about 3x
the pool). Goals: beyond the pool, TTFT p50 3x lower and output tok/s 1.3x with the tier; within
it, at most 2% of either lost; loads >= 40 GB/s.
"""

from __future__ import annotations

import argparse
import shutil

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import torch

from scheduler.engine import LLMEngine
from shared import gc_tuning
from shared.config import EngineConfig
from shared.logging import configure_logging
from testkit.multiturn_runs import load_rates, make_conversations, run_conversations
from testkit.quant_runs import SMOKE_LLAMA
from testkit.random_models import LLAMA3_8B, save_random_llama
from testkit.runs import log, print_command
from testkit.workloads import greedy, warmup_prompts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--smoke", action="store_true", help="tiny model and workload (checks the script)")
    parser.add_argument("--num-kv-blocks", type=int, help="the GPU pool (default 2048; 32 with --smoke)")
    parser.add_argument("--kv-offloading-size", type=float, help="GiB of host tier (default 24; 0.05 smoke)")
    parser.add_argument("--system-tokens", type=int, help="default 500 (24 with --smoke)")
    parser.add_argument("--user-tokens", type=int, help="default 400 (16 with --smoke)")
    parser.add_argument("--max-tokens", type=int, help="default 100 (8 with --smoke)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--within", type=int, help="conversations within the GPU pool (default 12; 3 smoke)")
    parser.add_argument("--beyond", type=int, help="conversations of ~3x the pool (default 48; 16 smoke)")
    parser.add_argument("--rate", type=float, default=4.0, help="conversation arrivals per second")
    parser.add_argument("--think-seconds", help="mean pause between a reply and the next turn; a comma list "
                        "runs the beyond case once per value, the first is the within case's "
                        "(default 5,1; 0.2 with --smoke)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        help="submit each step before the last is back (default: the device's, on on CUDA)")
    args = parser.parse_args(argv)
    small = args.smoke
    for name, default, smoke in (("num_kv_blocks", 2048, 32), ("kv_offloading_size", 24.0, 0.05),
                                 ("system_tokens", 500, 24), ("user_tokens", 400, 16), ("max_tokens", 100, 8),
                                 ("within", 12, 3), ("beyond", 48, 16), ("think_seconds", "5,1", "0.2")):
        if getattr(args, name) is None:
            setattr(args, name, smoke if small else default)
    args.think_seconds = [float(value) for value in str(args.think_seconds).split(",")]
    return args


def cases(args) -> list[tuple[str, int, int, float]]:
    """(name, conversations, seed, think seconds) of each measured case."""
    within = [("within", args.within, 1, args.think_seconds[0])]
    return within + [(f"beyond, think {think:g} s", args.beyond, 2, think) for think in args.think_seconds]


def measure(folder, args, vocab: int, tier: bool) -> dict:
    # for_device: the device's defaults for the rest (async scheduling on CUDA), as the fleet's
    # schedulers run; --no-async-scheduling for the engine that submits a step after the last is back.
    config = EngineConfig.for_device(torch.device(args.device).type, model=str(folder), device=args.device,
                                     dtype=args.dtype, num_kv_blocks=args.num_kv_blocks,
                                     kv_offloading_size=args.kv_offloading_size if tier else 0.0,
                                     max_num_batched_tokens=256 if args.smoke else 8192,
                                     async_scheduling=args.async_scheduling)
    engine = LLMEngine(config, load_tokenizer_files=False)
    try:
        # The kernels compile for these shapes now, not in the first measured turns.
        max_len = min(engine.max_model_len, args.num_kv_blocks * 16 // 2)
        engine.generate(warmup_prompts(vocab, max_len), greedy(8))
        gc_tuning.refreeze()  # (as LLMEngine.warm_up does: what the warm-up built lives on)
        out = {}
        for name, num, seed, think in cases(args):
            conversations = make_conversations(num, args.turns, system_tokens=args.system_tokens,
                                               user_tokens=args.user_tokens, rate=args.rate, vocab_size=vocab,
                                               seed=seed)
            log(f"{'tier' if tier else 'no tier'}: {name} the GPU pool, {num} conversations")
            out[name] = run_conversations(engine, conversations, args.max_tokens, think).row()
        if tier:
            out["rates"] = load_rates(engine)
        return out
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print_command()
    configure_logging("WARNING")
    shape = SMOKE_LLAMA if args.smoke else LLAMA3_8B
    vocab = shape["vocab_size"]
    folder = save_random_llama(shape, torch.device(args.device)).folder
    try:
        without = measure(folder, args, vocab, tier=False)
        with_tier = measure(folder, args, vocab, tier=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    per_conversation = args.system_tokens + args.turns * (args.user_tokens + args.max_tokens)
    pool = args.num_kv_blocks * 16
    within, beyond = args.within * per_conversation / pool, args.beyond * per_conversation / pool
    scheduling = {True: "async", False: "sync", None: "device default"}[args.async_scheduling]
    print(f"\n{'shape: tiny (smoke)' if args.smoke else 'Llama-3-8B shape'}, {args.dtype}, {args.device}, "
          f"{scheduling} scheduling, think times {', '.join(f'{t:g}' for t in args.think_seconds)} s (mean); "
          f"GPU pool {pool:,} tokens, host tier {args.kv_offloading_size} GiB; {args.turns} turns, "
          f"histories up to {per_conversation:,} tokens; working sets {within:.1f}x and {beyond:.1f}x "
          "the pool\n")
    print("| working set | measure | no tier | tier | ratio | goal |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    goals = {"beyond": {"ttft_p50_ms": "<= 1/3", "output_tok_s": ">= 1.3x"},
             "within": {"ttft_p50_ms": "<= 1.02x", "output_tok_s": ">= 0.98x"}}
    for case, *_ in cases(args)[1:] + cases(args)[:1]:
        for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "output_tok_s", "gpu_hit_tokens",
                    "host_hit_tokens", "load_gb_s"):
            a, b = without[case][key], with_tier[case][key]
            ratio = f"{b / a:.2f}x" if isinstance(a, float | int) and isinstance(b, float | int) and a else ""
            fmt = (lambda v: "-" if v is None else f"{v:,.1f}" if isinstance(v, float) else f"{v:,}")  # noqa: E731
            goal = goals[case.split(",")[0]].get(key, "")
            print(f"| {case.replace(',', ' the pool,', 1) if ',' in case else case + ' the pool'} | {key} "
                  f"| {fmt(a)} | {fmt(b)} | {ratio} | {goal} |")
    print("\n| host tier copies | GB/s |\n| --- | ---: |")
    for name, rate in with_tier["rates"].items():
        print(f"| {name} | {rate:,.1f} |")


if __name__ == "__main__":
    main()
