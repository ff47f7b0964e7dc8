"""Mixed-step CUDA graphs against eager mixed steps: the in-process engine under Poisson arrivals
of chats, and on a burst, in one run (docs/perf-notes.md, "Mixed steps in CUDA graphs").

    python3 scripts/bench_mixed_graphs.py                        # H200: Llama-3-8B shape, ~8 min
    python3 scripts/bench_mixed_graphs.py --smoke --device cpu   # tiny model: checks the script anywhere

Model: Llama-3-8B's shape with SmolLM2's vocabulary (49,152), random bf16 weights. Engine config:
what `tokenfleet scheduler` builds on CUDA (512 sequences, 8,192 tokens a step, decode graphs to
512), once with mixed graphs (to --cuda-graph-max-tokens) and once with every mixed step eager
(cuda_graph_max_tokens 0), each in a fresh engine of the same process.

Workload (random.Random(0)): chats that share one system prompt of --prefix-tokens random ids (the
prefix cache holds it after the first), then a distinct user turn of 52-390 ids (40-300 words),
~150 output tokens (lognormal, sigma 0.8, 16-512), greedy, EOS ignored. Poisson arrivals for
--seconds at each --rates; each request is added when its time comes (the loop checks between
steps). TTFT counts from the request's scheduled arrival. Then the 500-request ShareGPT-like
burst of scripts/bench_gpu.py.

Per run: output tok/s (output tokens / time from the first arrival to the last token), TTFT p50
and p99, ITL p99, the mean host time of a mixed step's forward (launch, or graph inputs plus
replay: the forward never waits for the GPU) and the share of wall time the engine thread waits
for the GPU (the sampler's copy of the chosen ids). --py-spy DIR records this process with py-spy
during the --py-spy-rate run of the mixed-graph engine.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import torch

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from testkit.arrivals import ServingRow, StepMeter, chat_arrivals, run_chats
from testkit.checkpoints import SMOLLM2_VOCAB_SIZE, tiny_llama_with_smollm2_tokenizer
from testkit.engine_runs import run_engine_workload, warm_up
from testkit.random_models import LLAMA3_8B, checkpoint_folder, random_llama
from testkit.runs import log, percentile, print_command
from testkit.workloads import sharegpt_workload


def run_burst(engine: LLMEngine, vocab: int, num_requests: int, device: torch.device,
              label: str) -> ServingRow:
    meter = StepMeter()
    meter.attach(engine)
    run = run_engine_workload(engine, sharegpt_workload(num_requests, vocab), 600.0, device)
    meter.detach(engine)
    ttft = [times[0] - run.start for times in run.token_times.values()]
    itl = [b - a for times in run.token_times.values() for a, b in zip(times, times[1:], strict=False)]
    mixed = meter.mixed_forward_s
    return ServingRow(label, run.output_rate, percentile(ttft, 50), percentile(ttft, 99),
                      percentile(itl, 99), 1e3 * sum(mixed) / max(1, len(mixed)), len(mixed),
                      meter.graph_steps, meter.gpu_wait_s / run.seconds)


def start_py_spy(out_dir: Path, seconds: float) -> subprocess.Popen | None:
    exe = shutil.which("py-spy")
    if exe is None:
        log("py-spy not found: no profile")
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([exe, "record", "-p", str(os.getpid()), "-d", str(int(seconds)), "-r", "200",
                             "-f", "raw", "-o", str(out_dir / "mixed_graphs_engine.txt")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and workload")
    parser.add_argument("--rates", default="16,48,64", help="Poisson arrival rates, requests/s")
    parser.add_argument("--seconds", type=float, default=15.0, help="arrivals last this long at each rate")
    parser.add_argument("--prefix-tokens", type=int, default=800)
    parser.add_argument("--burst", type=int, default=500, help="requests of the burst (0: none)")
    parser.add_argument("--burst-repeats", type=int, default=1, help="bursts run one after the other")
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--cuda-graph-max-tokens", type=int, default=2048)
    parser.add_argument("--modes", default="graphs,eager", help="which engines: graphs, eager")
    parser.add_argument("--py-spy", type=Path, help="folder for a py-spy profile of the graphs engine")
    parser.add_argument("--py-spy-rate", type=float, default=48.0)
    args = parser.parse_args(argv)
    print_command()
    device = torch.device(args.device)
    rates = [float(r) for r in args.rates.split(",") if r]
    if args.smoke:
        args.seconds, args.prefix_tokens, args.burst = min(args.seconds, 3.0), 64, min(args.burst, 16)
        rates = [min(r, 4.0) for r in rates]

    folder = checkpoint_folder(16 << 30)
    try:
        if args.smoke:
            tiny_llama_with_smollm2_tokenizer(folder, None, max_position_embeddings=2048)
            description, vocab = "tiny random llama, float32", SMOLLM2_VOCAB_SIZE
        else:
            model = random_llama({**LLAMA3_8B, "vocab_size": SMOLLM2_VOCAB_SIZE}, device)
            model.save_pretrained(folder)
            del model
            gc.collect()
            torch.cuda.empty_cache()
            description, vocab = f"Llama-3-8B shape, vocab {SMOLLM2_VOCAB_SIZE:,}, bf16", SMOLLM2_VOCAB_SIZE
        prefix = [random.Random(1).randrange(3, vocab) for _ in range(args.prefix_tokens)]
        rows: list[ServingRow] = []
        for mode in args.modes.split(","):
            max_tokens = args.cuda_graph_max_tokens if mode == "graphs" else 0
            config = EngineConfig(model=str(folder), device=args.device, max_num_seqs=args.max_num_seqs,
                                  cuda_graph_max_batch_size=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  cuda_graph_max_tokens=max_tokens)
            started = time.perf_counter()
            with LLMEngine(config, load_tokenizer_files=False) as engine:
                log(f"{mode}: engine ready in {time.perf_counter() - started:.1f} s "
                    f"({engine.executor.num_kv_blocks} KV blocks)")
                warm_up(engine, vocab)
                for rate in rates:
                    chats = chat_arrivals(rate, args.seconds, prefix, vocab, seed=0)
                    spy = None
                    if args.py_spy and mode == "graphs" and rate == args.py_spy_rate:
                        spy = start_py_spy(args.py_spy, args.seconds)
                    rows.append(run_chats(engine, chats, f"{mode}, {rate:g} req/s"))
                    if spy is not None:
                        spy.wait(timeout=60)
                    log(str(rows[-1]))
                for _ in range(args.burst_repeats if args.burst else 0):
                    label = f"{mode}, burst of {args.burst}"
                    rows.append(run_burst(engine, vocab, args.burst, device, label))
                    log(str(rows[-1]))
            gc.collect()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"\n{description}; engine config as `tokenfleet scheduler` on CUDA; "
          f"mixed graphs to {args.cuda_graph_max_tokens} tokens\n")
    print("| run | output tok/s | TTFT p50 | TTFT p99 | ITL p99 | host ms per mixed forward "
          "| mixed steps (in graphs) | waiting on the GPU |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r.label} | {r.tok_s:,.0f} | {1e3 * r.ttft_p50:.0f} ms | {1e3 * r.ttft_p99:.0f} ms "
              f"| {1e3 * r.itl_p99:.0f} ms | {r.mixed_ms:.2f} | {r.mixed_steps} ({r.graph_steps}) "
              f"| {r.gpu_wait:.0%} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
