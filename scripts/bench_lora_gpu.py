"""LoRA adapters against the base model alone on one GPU, in one run: a burst spread over
adapters, batch-1 decode on an adapter, an adapter's first load.

    python3 scripts/bench_lora_gpu.py                         # H200: Llama-3-8B shape, rank 16 on all 7
    python3 scripts/bench_lora_gpu.py --smoke --device cpu    # tiny model and workload: checks the script

A random-weight Llama-3-8B-shaped checkpoint (bench_quant.py's) and --num-adapters random
adapters of --rank on all seven projections (written straight in the PEFT format). Two engines,
one after the other: the base alone (no --enable-lora), then one with --enable-lora, --max-loras
= the number of adapters. Reported, the baseline measured in the same run:
- output tok/s of a burst of --num-requests (bench_gpu's ShareGPT-like lengths): the base on the
  base engine; on the LoRA engine, request i on adapter i mod N (goal: >= 0.8x);
- batch-1 decode ms/token, 128 prompt + 128 output tokens: the base on the base engine; an
  adapter on the LoRA engine (goal: <= 1.15x); and the base on the LoRA engine (what enabling
  adapters costs requests that use none);
- an adapter's first load, after the burst: from disk into the LRU slot (goal: <= 100 ms).
"""

from __future__ import annotations

import argparse
import shutil

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import torch

from shared.logging import configure_logging
from testkit.lora_adapters import write_random_adapter
from testkit.lora_runs import first_load_ms, lora_engine, measure
from testkit.quant_runs import SMOKE_LLAMA
from testkit.random_models import LLAMA3_8B, save_random_llama
from testkit.runs import log, print_command
from testkit.workloads import sharegpt_workload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--smoke", action="store_true", help="tiny model and workload (checks the script)")
    parser.add_argument("--num-requests", type=int, help="default 500 (16 with --smoke)")
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print_command()
    configure_logging("WARNING")
    device = torch.device(args.device)
    shape = SMOKE_LLAMA if args.smoke else LLAMA3_8B
    vocab = shape["vocab_size"]
    num_requests = args.num_requests or (16 if args.smoke else 500)
    workload = sharegpt_workload(num_requests, vocab, prompt_max=200 if args.smoke else 1024,
                                 output_max=32 if args.smoke else 512)
    folder = save_random_llama(shape, device).folder
    try:
        log("writing adapters")
        adapters = {f"lora{i}": str(write_random_adapter(folder, folder / "adapters" / f"lora{i}",
                                                         rank=args.rank, seed=i))
                    for i in range(args.num_adapters + 1)}  # the last one: the first-load measurement
        late_name, late_path = adapters.popitem()
        log("base engine")
        engine = lora_engine(folder, args)
        try:
            base = measure(engine, args, workload, vocab, [None])
        finally:
            engine.close()
        log("LoRA engine")
        engine = lora_engine(folder, args, enable_lora=True, lora_modules=adapters, max_loras=len(adapters),
                         max_lora_rank=args.rank)
        try:
            lora = measure(engine, args, workload, vocab, list(adapters))
            lora["first_load"] = first_load_ms(engine, late_name, late_path, vocab)
            dense = engine.executor.runner.lora.is_dense
            graphs = engine.executor.runner.decode_graphs is not None
        finally:
            engine.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    path = "shrink in the base GEMM, one Triton expand kernel" if dense else "segment-wise"
    print(f"\n{'shape: tiny (smoke)' if args.smoke else 'Llama-3-8B shape'}, {args.dtype}, {device}; "
          f"{args.num_adapters} adapters of rank {args.rank} on q, k, v, o, gate, up, down; "
          f"LoRA path: {path}, "
          f"decode CUDA graphs {'on' if graphs else 'off'}\n")
    print("| measure | base alone | with LoRA | ratio | goal |")
    print("| --- | ---: | ---: | ---: | --- |")
    print(f"| {num_requests}-request burst, output tok/s (LoRA: over {args.num_adapters} adapters) | "
          f"{base['burst']:,.0f} | {lora['burst']:,.0f} | {lora['burst'] / base['burst']:.2f}x | >= 0.8x |")
    print(f"| batch-1 decode, ms/token (LoRA: on an adapter) | {base['decode']:.2f} | {lora['decode']:.2f} | "
          f"{lora['decode'] / base['decode']:.2f}x | <= 1.15x |")
    print(f"| batch-1 decode, ms/token, no adapter on the LoRA engine | {base['decode']:.2f} | "
          f"{lora['decode_base']:.2f} | {lora['decode_base'] / base['decode']:.2f}x | |")
    print(f"| an adapter's first load (disk to slot), ms | | {lora['first_load']:.1f} | | <= 100 ms |")


if __name__ == "__main__":
    main()
