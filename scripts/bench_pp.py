"""Pipeline parallelism against tensor parallelism on two GPUs, in one call on a two-GPU machine.

    python3 scripts/bench_pp.py                                        # 2 GPUs, Llama-3-8B shape
    python3 scripts/bench_pp.py --smoke --device cpu --dtype float32   # tiny model, gloo: checks the script

Builds a Llama-3-8B-shaped checkpoint with random bf16 weights, then, each through a Ray worker
group in this one process (engines one after the other, each closed before the next):
1. throughput of TP=1, TP=2 and PP=2 on the ShareGPT-like workload of scripts/bench_gpu.py
   (fewer requests), output tokens/s;
2. batch-1 decode latency (ms per token of one request alone);
3. greedy tokens of TP=2 and PP=2 against TP=1 (match rate; bf16, random weights);
4. weight bytes per rank: each PP stage holds half the layers;
5. the bytes that cross between GPUs per step: PP=2's stage hand-off (one [tokens, hidden]
   activation) against TP=2's all-reduces (two per layer) and logits all-gather, counted on a
   short profiled run of each (EngineConfig.time_collectives; those steps run eagerly).
NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends), set before anything starts.
Prints the command line first and one markdown table last; a failed measurement is a row.
"""

from __future__ import annotations

import os

import _repo  # noqa: F401 - first: it puts the repository on sys.path

from shared.config import MULTICAST_OFF_ENV

os.environ.update(MULTICAST_OFF_ENV)  # before torch, NCCL or Ray start

import argparse  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

from shared.config import EngineConfig  # noqa: E402
from shared.logging import configure_logging  # noqa: E402
from testkit import random_models  # noqa: E402
from testkit.engine_runs import start_local_ray  # noqa: E402
from testkit.pp_runs import measure, traffic  # noqa: E402
from testkit.random_models import LLAMA3_8B, checkpoint_folder, save_random_llama  # noqa: E402
from testkit.runs import log, print_command  # noqa: E402
from testkit.workloads import sharegpt_workload  # noqa: E402
from workers.model_runner import format_bytes  # noqa: E402

TINY_LLAMA = {**random_models.TINY_LLAMA, "num_hidden_layers": 4}  # two layers per stage
LAYOUTS = {"TP=1": dict(tp=1, pp=1), "TP=2": dict(tp=2, pp=1), "PP=2": dict(tp=1, pp=2)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--smoke", action="store_true", help="tiny model and workload (checks the script)")
    parser.add_argument("--num-requests", type=int, help="throughput workload (default 300; 12 with --smoke)")
    parser.add_argument("--num-prompts", type=int, default=16, help="greedy cross-check prompts")
    parser.add_argument("--num-tokens", type=int, default=32, help="greedy cross-check tokens")
    parser.add_argument("--batch1-tokens", type=int, default=128)
    parser.add_argument("--traffic-requests", type=int, default=32)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="which of TP=1,TP=2,PP=2 to run")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print_command()
    configure_logging("WARNING")
    device = torch.device(args.device)
    start_local_ray(MULTICAST_OFF_ENV)
    shape = TINY_LLAMA if args.smoke else LLAMA3_8B
    folder = checkpoint_folder(1 << 20 if args.smoke else 17 << 30)
    rows: list[tuple[str, ...]] = []
    results, flows = [], []
    try:
        start = time.perf_counter()
        _, num_params, checkpoint_bytes = save_random_llama(shape, device, folder)
        log(f"checkpoint: {num_params / 1e9:.2f} B parameters, {format_bytes(checkpoint_bytes)} "
            f"in {time.perf_counter() - start:.0f} s")
        vocab = shape["vocab_size"]
        rng = random.Random(3)
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 256))]
                   for _ in range(args.num_prompts)]
        workload = sharegpt_workload(args.num_requests or (12 if args.smoke else 300), vocab,
                                     prompt_max=200 if args.smoke else 1024,
                                     output_max=32 if args.smoke else 512)
        small = sharegpt_workload(args.traffic_requests, vocab, prompt_max=200 if args.smoke else 512,
                                  output_max=16 if args.smoke else 64)
        base = dict(model=str(folder), device=args.device, dtype=args.dtype, use_ray=True, max_num_seqs=256,
                    max_num_batched_tokens=8192, step_timeout_s=120.0, max_group_restarts=0)
        for name in args.layouts.split(","):
            config = EngineConfig(**base, **LAYOUTS[name])
            try:
                results.append(measure(name, config, args, vocab, prompts, workload, device))
            except Exception as exc:  # noqa: BLE001 - a failed measurement is a row
                traceback.print_exc()
                first_line = str(exc).splitlines()[0][:300] if str(exc) else ""
                rows.append((name, f"FAILED: {type(exc).__name__}", first_line))
            if name != "TP=1":
                try:
                    flows.append(traffic(name, config, small, device))
                except Exception as exc:  # noqa: BLE001
                    traceback.print_exc()
                    rows.append((f"{name} traffic", f"FAILED: {type(exc).__name__}", str(exc)[:300]))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report(args, shape, results, flows, rows, device)


def report(args, shape, results: list[dict], flows: list[dict], failures: list[tuple], device) -> None:
    base = next((r for r in results if r["name"] == "TP=1"), None)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    what = "tiny llama" if args.smoke else "Llama-3-8B shape"
    print(f"\n{'SMOKE RUN, not a measurement: ' if args.smoke else ''}PP=2 vs TP=2 vs TP=1, "
          f"{what} ({args.dtype}), {where}, Ray worker groups\n")
    print("| layout | output tok/s | vs TP=1 | batch-1 ms/token | vs TP=1 | weights per rank | KV blocks | "
          "greedy vs TP=1 | notes |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | --- | --- |")
    for r in results:
        rate_ratio = f"{r['rate'] / base['rate']:.2f}x" if base else "n/a"
        latency_ratio = f"{r['batch1_ms'] / base['batch1_ms']:.2f}x" if base else "n/a"
        match = _match(r["greedy"], base["greedy"]) if base and r is not base else "reference"
        print(f"| {r['name']} | {r['rate']:,.0f} | {rate_ratio} | {r['batch1_ms']:.2f} | {latency_ratio} | "
              f"{', '.join(format_bytes(b) for b in r['weight_bytes'])} | {r['kv_blocks']:,} | {match} | "
              f"peak {r['peak_in_flight']} step(s) in flight; {r['notes']} |")
    for name, result, notes in failures:
        print(f"| {name} | {result} | | | | | | | {notes} |")
    if flows:
        print("\n| layout | bytes between GPUs per step (rank 0) | per token | collectives | "
              "stage hand-off | share of GPU step time |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for f in flows:
            total = f["collective_bytes"] + f["p2p_bytes"]
            share = f"{f['share']:.1%}" if f["share"] is not None else "n/a (CPU)"
            print(f"| {f['name']} | {format_bytes(total // max(f['steps'], 1))} | "
                  f"{total / max(f['tokens'], 1) / 1e3:.1f} kB | {format_bytes(f['collective_bytes'])} | "
                  f"{format_bytes(f['p2p_bytes'])} | {share} |")
        print(f"\n(hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers: a stage hand-off "
              f"moves hidden x 2 bytes per token once a step; TP=2 all-reduces 2 x layers + 1 times a "
              f"step, plus the logits all-gather)")


def _match(ours: list[list[int]], reference: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(ours, reference, strict=True))
    return f"{same}/{len(reference)} prompts identical"


if __name__ == "__main__":
    main()
