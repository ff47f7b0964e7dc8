"""Where the CUDA engine's step time goes, on the workload of scripts/bench_gpu.py. Run by
hand on a GPU machine (one call, ~3 minutes):

    python3 scripts/profile_gpu.py [--num-requests 500]
    python3 scripts/profile_gpu.py --kernels        # the attention kernel alone, ~1 minute

Prints: time per step kind (decode-only CUDA-graph steps, mixed prefill+decode steps) with
their counts and token totals, and the top CUDA kernels and CPU ops of a few steps of each
kind under torch.profiler. With --kernels: the Triton paged-attention kernel on one layer of
Llama-3-8B-shaped steps, per tile shape / warps / pipeline depth, as time and as K/V bytes
read per second (the bound: K/V bytes over the copy bandwidth).
"""

from __future__ import annotations

import argparse
import shutil

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import torch

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from testkit.gpu_profile import kernel_rows, profile_steps
from testkit.random_models import LLAMA3_8B, checkpoint_folder, save_random_llama
from testkit.runs import print_command
from testkit.workloads import greedy, sharegpt_workload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=500)
    parser.add_argument("--kernels", action="store_true", help="time the attention kernel alone")
    parser.add_argument("--steps", help="--kernels: only the steps whose name holds this (e.g. decode)")
    parser.add_argument("--configs", help="--kernels: only the configs whose text holds this (e.g. segments)")
    args = parser.parse_args()
    print_command()
    if args.kernels:
        print("| step | K/V | config | us eager | us graph | K/V GB/s (graph) |\n"
              "| --- | --- | --- | ---: | ---: | ---: |")
        for row in kernel_rows(args.steps, args.configs):
            print(row, flush=True)
        return
    device = torch.device("cuda")
    folder = save_random_llama(LLAMA3_8B, device, checkpoint_folder(16 << 30)).folder
    try:
        engine = LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16",
                                        max_num_seqs=256, max_num_batched_tokens=8192),
                           load_tokenizer_files=False)
        workload = sharegpt_workload(args.num_requests, LLAMA3_8B["vocab_size"])
        engine.generate([workload.prompts[0][:16]], greedy(4))
        for prompt, num_out in zip(workload.prompts, workload.max_tokens, strict=True):
            engine.add_request(prompt, greedy(num_out))
        profile = profile_steps(engine)
        stats, total = profile.stats, profile.total_s
        mixed_sizes, prof_tables = profile.mixed_sizes, profile.prof_tables
        print(f"\ntotal {total:.1f} s, {args.num_requests} requests (each execute synchronised)", flush=True)
        print("| step kind | steps | seconds in execute | ms per step | tokens per step |\n"
              "| --- | ---: | ---: | ---: | ---: |")
        for kind, (steps, seconds, tokens) in stats.items():
            print(f"| {kind} | {steps} | {seconds:.1f} | {1e3 * seconds / max(steps, 1):.1f} | "
                  f"{tokens / max(steps, 1):.0f} |")
        print(f"| scheduler and the rest | | {total - stats['decode'][1] - stats['mixed'][1]:.1f} | | |")
        if mixed_sizes:
            sizes = sorted(mixed_sizes)
            print("mixed steps (prefill tokens, decodes): min", sizes[0], "median", sizes[len(sizes) // 2],
                  "max", sizes[-1], flush=True)
        for kind, profs in prof_tables.items():
            prof, num_tokens = profs[-1]
            print(f"\n## {kind} steps under the profiler (last of {len(profs)}: {num_tokens} tokens)")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))
        engine.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
