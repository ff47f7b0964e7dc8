"""Where the CUDA engine's step time goes, on the workload of scripts/bench_gpu.py. Run by
hand on a GPU machine (one call, ~3 minutes):

    python3 scripts/profile_gpu.py [--num-requests 500]

Prints: time per step kind (decode-only CUDA-graph steps, mixed prefill+decode steps) with
their counts and token totals, and the top CUDA kernels and CPU ops of a few steps of each
kind under torch.profiler.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_gpu, beside this file

from bench_gpu import LLAMA3_8B, build_model, checkpoint_folder, make_workload  # noqa: E402

from scheduler.engine import LLMEngine  # noqa: E402
from shared.config import EngineConfig  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=500)
    args = parser.parse_args()
    print("command:", " ".join(sys.argv), flush=True)
    device = torch.device("cuda")
    model = build_model(LLAMA3_8B, device)
    folder = checkpoint_folder(16 << 30)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    try:
        engine = LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16",
                                        max_num_seqs=256, max_num_batched_tokens=8192),
                           load_tokenizer_files=False)
        workload = make_workload(args.num_requests, LLAMA3_8B["vocab_size"])
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        engine.generate([workload.prompts[0][:16]], warm)
        for prompt, num_out in zip(workload.prompts, workload.max_tokens, strict=True):
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=num_out, ignore_eos=True))
        stats = {"decode": [0, 0.0, 0], "mixed": [0, 0.0, 0]}  # kind -> [steps, seconds, tokens]
        profiled = {"decode": 0, "mixed": 0}
        prof_tables = {}
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            sched = engine.scheduler
            # Peek: a step is decode-only when every running request has computed its prompt.
            kind = "mixed" if sched.num_waiting_requests or any(
                r.num_tokens - r.num_computed_tokens > 1 for r in sched._running) else "decode"
            do_profile = profiled[kind] < 3 and stats[kind][0] >= 5
            t0 = time.perf_counter()
            if do_profile:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    engine.step()
                    torch.cuda.synchronize()
                profiled[kind] += 1
                prof_tables.setdefault(kind, []).append(prof)
            else:
                engine.step()
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            stats[kind][0] += 1
            stats[kind][1] += elapsed
        total = time.perf_counter() - start
        print(f"\ntotal {total:.1f} s for {args.num_requests} requests", flush=True)
        print("| step kind | steps | seconds | ms per step |\n| --- | ---: | ---: | ---: |")
        for kind, (steps, seconds, _) in stats.items():
            print(f"| {kind} | {steps} | {seconds:.1f} | {1e3 * seconds / max(steps, 1):.1f} |")
        for kind, profs in prof_tables.items():
            print(f"\n## {kind} steps under the profiler (last of {len(profs)})")
            print(profs[-1].key_averages().table(sort_by="cuda_time_total", row_limit=15))
            print(profs[-1].key_averages().table(sort_by="cpu_time_total", row_limit=12))
        engine.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
