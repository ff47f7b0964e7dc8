"""Quantized weights and the FP8 KV cache against bf16 on one GPU, in one run: speed, bytes, the
budget, accuracy.

    python3 scripts/bench_quant.py                        # H200: Llama-3-8B shape, 500 requests, + KV
    python3 scripts/bench_quant.py --no-kv                # H200: the weights part alone (~7 min)
    python3 scripts/bench_quant.py --kv-only              # H200: the FP8 KV cache part alone
    python3 scripts/bench_quant.py --linears              # H200: the per-linear table alone
    python3 scripts/bench_quant.py --methods bf16,fp8,fp8+w8a8 --no-kv   # H200: with the w8a8 GEMM
    python3 scripts/bench_quant.py --smoke --device cpu   # tiny model and workload: checks the script
    python3 scripts/bench_quant.py --device cpu --dtype float32 --methods bf16,fp8,int8 \
        --accuracy-model PATH --accuracy-only             # perplexity (weights x KV cache) alone

For each method (bf16, fp8, int8 as --methods says) an engine loads the same random-weight
Llama-3-8B-shaped checkpoint (bench_gpu.py's) and runs bench_gpu's 500-request workload, then
its batch-1 decode latency. Reported against bf16, measured in the same run:
- output tok/s and its ratio (goal for fp8 on an H200: >= 1.4x);
- batch-1 decode ms/token and its ratio (goal: <= 0.6x);
- weight bytes per rank and their ratio (goal: halved, embedding and LM head aside);
- the budget of the seed's scenario: a per-rank budget of 60% of the bf16 weights, which bf16
  must be refused under and each quantized method loads under (its engine runs with it);
- accuracy on the random model: the relative error of the last-position logits against bf16
  and the share of 16 greedy 32-token outputs identical to bf16's. With --accuracy-model (a real
  checkpoint such as SmolLM2), also the perplexity of README.md under each method, with the
  serving dtype's KV cache and with an FP8 one, and greedy agreement with the baseline;
- int8 on CUDA: the refusal (no kernel there yet dequantizes in registers);
- the FP8 KV cache (bf16 weights): a long-context workload (64 requests, 8,192-token prompts, 512
  outputs) with a bf16 and an FP8 cache: output tok/s (goal >= 1.25x) and KV blocks (>= 1.9x).
`--linears` prints the per-linear table of testkit/quant_linears.py instead.
"""

from __future__ import annotations

import argparse
import random
import shutil
import time
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import torch

from shared.logging import configure_logging
from testkit.quant_runs import (
    LONG_OUTPUT,
    LONG_PROMPT,
    SMOKE_LLAMA,
    WEIGHT_METHODS,
    accuracy,
    bf16_refused_under,
    kv_long_context,
    measure,
)
from testkit.quant_runs import engine_config as engine_config  # (how its engines are built: tested)
from testkit.random_models import LLAMA3_8B, save_random_llama
from testkit.runs import log, print_command
from testkit.workloads import sharegpt_workload
from workers.layers import fp8_tuning
from workers.model_runner import format_bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny model and workload (checks the script)")
    parser.add_argument("--methods", default="bf16,fp8",
                        help="comma-separated: bf16, fp8, int8, fp8+kv8 (FP8 weights and KV cache), "
                             "fp8-no-w8a8 (FP8 weights, the tuner without its Triton FP8 x FP8 GEMM)")
    parser.add_argument("--num-requests", type=int, help="default 500 (24 with --smoke)")
    parser.add_argument("--engine-seconds", type=float, default=240.0)
    parser.add_argument("--accuracy-model", type=Path, help="a real checkpoint for perplexity (e.g. SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16", help="serving dtype (float32 for CPU accuracy runs)")
    parser.add_argument("--linears", action="store_true",
                        help="only the per-linear table (testkit/quant_linears.py)")
    parser.add_argument("--no-w8a8", action="store_true",
                        help="--linears: the tuner leaves out its FP8 x FP8 GEMM (fp8_tuning.TRY_W8A8)")
    parser.add_argument("--no-kv", action="store_true", help="skip the FP8 KV cache's long-context workload")
    parser.add_argument("--kv-only", action="store_true", help="only the FP8 KV cache's long-context run")
    parser.add_argument("--accuracy-only", action="store_true",
                        help="only the --accuracy-model table (no random model, no engines)")
    return parser.parse_args(argv)


def print_accuracy(rows: list[dict], args) -> None:
    base = rows[0]
    print(f"\nAccuracy, {args.accuracy_model.name}, serving dtype {args.dtype} ('bf16' = no weight "
          "quantization), README.md: perplexity of 2,048 tokens; greedy 16 prompts x 32 tokens vs the "
          "first row")
    print("| weights | KV cache | perplexity | vs first row | tokens identical | first tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "refused" in r:
            print(f"| {r['method']} | {r['kv']} | refused: {r['refused'][:90]} | | | |")
            continue
        pairs = list(zip(r["outputs"], base["outputs"], strict=True))
        same = sum(a == b for s, t in pairs for a, b in zip(s, t, strict=True))
        firsts = sum(s[0] == t[0] for s, t in pairs)
        change = r["perplexity"] / base["perplexity"] - 1
        print(f"| {r['method']} | {r['kv']} | {r['perplexity']:.3f} | {change:+.1%} | {same}/{16 * 32} "
              f"| {firsts}/16 |")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print_command()
    configure_logging("WARNING")
    if args.linears:
        from testkit.quant_linears import linear_table

        fp8_tuning.TRY_W8A8 = not args.no_w8a8

        print("\n".join(linear_table(torch.device(args.device), smoke=args.smoke)))
        return
    methods = args.methods.split(",")
    if methods[0] != "bf16" or not set(methods) <= set(WEIGHT_METHODS):
        others = ", ".join(list(WEIGHT_METHODS)[1:])
        raise SystemExit(f"--methods: bf16 first (the baseline), then any of {others}")
    if args.accuracy_only:
        if not args.accuracy_model:
            raise SystemExit("--accuracy-only needs --accuracy-model")
        print_accuracy(accuracy(args.accuracy_model, methods, args), args)
        return
    device = torch.device(args.device)
    # Llama-3-8B's window is 8,192: the long-context workload's 8,192 + 512 need a little more
    # (Llama 3.1's shapes are the same with a longer window); the 500-request engines stay at 8,192.
    long_window = LONG_PROMPT + LONG_OUTPUT
    shape = SMOKE_LLAMA if args.smoke else {**LLAMA3_8B, "max_position_embeddings": long_window}
    num_requests = args.num_requests or (24 if args.smoke else 500)
    workload = sharegpt_workload(num_requests, shape["vocab_size"], prompt_max=200 if args.smoke else 1024,
                                 output_max=48 if args.smoke else 512)
    rng = random.Random(7)
    prompts = [[rng.randrange(shape["vocab_size"]) for _ in range(rng.randrange(16, 200))] for _ in range(16)]
    folder, _, bf16_bytes = save_random_llama(shape, device)
    budget = int(0.6 * bf16_bytes)
    results = []
    try:
        for method in [] if args.kv_only else methods:
            start = time.perf_counter()
            results.append(measure(method, folder, args, workload, shape["vocab_size"], budget, prompts))
            log(f"{method}: {results[-1].get('output_rate', 0):,.0f} output tok/s, "
                f"{results[-1].get('ms_per_token', 0):.2f} ms/token ({time.perf_counter() - start:.0f} s)")
        refusal = "" if args.kv_only else bf16_refused_under(folder, args, budget)
        kv_rows = [] if args.no_kv else kv_long_context(folder, args)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    accuracy_rows = accuracy(args.accuracy_model, methods, args) if args.accuracy_model else []
    if results:
        print_results(results, args, device, num_requests, budget, refusal)
    if kv_rows:
        print_kv(kv_rows, args)
    if accuracy_rows:
        print_accuracy(accuracy_rows, args)


def print_kv(rows: list[dict], args) -> None:
    auto, fp8 = rows
    prompt, output = (256, 32) if args.smoke else (LONG_PROMPT, LONG_OUTPUT)
    print(f"\nFP8 KV cache, bf16 weights: {8 if args.smoke else 64} requests, {prompt:,}-token prompts, "
          f"{output} outputs")
    print("| KV cache | output tok/s | vs bf16 KV | decode-phase tok/s | vs bf16 KV | KV blocks | vs bf16 KV "
          "| seconds (decode phase) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        decode = (f"{r['decode_rate']:,.0f} | {r['decode_rate'] / auto['decode_rate']:.2f}x"
                  if r["decode_rate"] and auto["decode_rate"] else "- | -")
        print(f"| {'fp8' if r['kv'] == 'fp8' else args.dtype} | {r['output_rate']:,.0f}"
              f"{' (partial)' if r['partial'] else ''} | {r['output_rate'] / auto['output_rate']:.2f}x "
              f"| {decode} | {r['blocks']:,} | {r['blocks'] / auto['blocks']:.2f}x | {r['seconds']:.1f} "
              f"({r['decode_seconds'] or 0:.1f}) |")


def print_results(results: list[dict], args, device: torch.device, num_requests: int, budget: int,
                  refusal: str) -> None:
    base = results[0]
    print(f"\n{'SMOKE RUN, not a measurement: ' if args.smoke else ''}{device}, "
          f"{'tiny' if args.smoke else 'Llama-3-8B'} shape, {num_requests} requests; "
          f"budget {format_bytes(budget)}/rank (60% of bf16); bf16 under it: {refusal}\n")
    print("| method | output tok/s | vs bf16 | batch-1 ms/token | vs bf16 | weight bytes/rank | vs bf16 "
          "| logits rel. err | greedy same |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "refused" in r:
            print(f"| {r['method']} | refused: {r['refused']} | | | | | | | |")
            continue
        error = float((r["logits"] - base["logits"]).norm() / base["logits"].norm())
        same = sum(a == b for a, b in zip(r["outputs"], base["outputs"], strict=True))
        print(f"| {r['method']} | {r['output_rate']:,.0f}{' (partial)' if r['partial'] else ''} "
              f"| {r['output_rate'] / base['output_rate']:.2f}x | {r['ms_per_token']:.2f} "
              f"| {r['ms_per_token'] / base['ms_per_token']:.2f}x | {format_bytes(r['weight_bytes'])} "
              f"| {r['weight_bytes'] / base['weight_bytes']:.2f}x | {error:.4f} | {same}/16 |")


if __name__ == "__main__":
    main()
