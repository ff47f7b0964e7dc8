"""What grammar-constrained decoding costs: decode steps with and without a JSON schema, the
grammar work left on the step's critical path, a large mixed batch, and a whole workload's
throughput, each against unconstrained decoding of the same requests in the same run.

    python scripts/bench_structured.py --device cuda --tokenizer DIR   # H200: Llama-3-8B shape, bf16
    .venv/bin/python scripts/bench_structured.py --smoke # CPU: a tiny random llama, small sizes

Decode-step passes (prompts of random ids, temperature 1 with a seed each, EOS ignored where no
grammar ends them; timed: decode steps with every row present and past its prompt):
  (a) --batch rows unconstrained;  (b) the same rows, every one under one JSON schema whose answer
  cannot end within the run (a long free string first), so every matcher works every step;
  (c) as (b) with the grammar's parts timed: the bitmask fill (on the host, while the forward
  runs; "hidden" counts the steps where the device was still busy when the fill ended), the mask
  applied to the logits (synchronised to time it), the matchers accepting the tokens;
  (d) --mixed-batch rows unconstrained;  (e) the same with a quarter of them constrained.
Throughput: --requests requests (prompts of random length, --output-len tokens each) run to the
end through `generate`, unconstrained, then every one under the schema. Fill threads: the fill of
64 to 512 rows on 1..16 threads (xgrammar's batch matcher), matchers advanced by random tokens.
Async scheduling: --async-scheduling on|off (default: the device's, on for CUDA), so that the
throughput rows are the fully constrained 500-request burst against the unconstrained one with
it on. Prints the command first and the tables last.
"""

from __future__ import annotations

import argparse

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import torch

from scheduler.engine import LLMEngine
from scheduler.grammar import available_cores
from shared.config import EngineConfig
from shared.logging import configure_logging
from testkit.runs import print_command
from testkit.structured_runs import FILL_ROWS, FILL_THREADS, StructuredRun, prepare_model, run_passes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--model", help="a model folder with a tokenizer (default: a random Llama-3-8B "
                                        "shape with SmolLM2's tokenizer on cuda, SmolLM2 on cpu)")
    parser.add_argument("--tokenizer", help="cuda: folder with SmolLM2's tokenizer files (default: the "
                                            "default model's)")
    parser.add_argument("--smoke", action="store_true", help="a tiny random model, small sizes (CPU check)")
    parser.add_argument("--batch", type=int, help="rows of the decode passes (default 64; 16 with --smoke)")
    parser.add_argument("--mixed-batch", type=int, help="rows of the mixed pass, a quarter constrained "
                                                        "(default 256; 32 with --smoke)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, help="timed decode steps per pass (default 64 cuda, 8 cpu)")
    parser.add_argument("--requests", type=int, help="throughput workload (default 500 cuda, 24 cpu)")
    parser.add_argument("--output-len", type=int, help="tokens per request there (default 128 cuda, 16 cpu)")
    parser.add_argument("--threads", type=int, help="torch threads on cpu (default: torch's)")
    parser.add_argument("--async-scheduling", choices=("on", "off"),
                        help="default: the device's (on for cuda, off for cpu)")
    args = parser.parse_args(argv)
    print_command()
    configure_logging("WARNING")
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    num_steps = args.steps or (64 if on_gpu else 4 if args.smoke else 8)
    args.batch = args.batch or (16 if args.smoke else 64)
    mixed_batch = args.mixed_batch = args.mixed_batch or (32 if args.smoke else 256)
    num_requests = args.requests or (500 if on_gpu else 16)
    output_len = args.output_len or (128 if on_gpu else 8)
    fill_rows = tuple(r // 4 for r in FILL_ROWS[:2]) if args.smoke else FILL_ROWS
    fill_threads = tuple(t for t in FILL_THREADS if t <= max(2, available_cores()))
    folder, description = prepare_model(args)
    max_seqs = max(args.batch, mixed_batch)
    async_scheduling = None if args.async_scheduling is None else args.async_scheduling == "on"
    config = EngineConfig.for_device(device.type, model=folder, device=args.device, dtype=args.dtype,
                                     max_num_seqs=max_seqs,
                                     max_num_batched_tokens=max(2048, max_seqs * args.prompt_len),
                                     cuda_graph_max_batch_size=max_seqs, num_threads=args.threads,
                                     async_scheduling=async_scheduling)
    args.async_scheduling = "on" if config.async_scheduling else "off"
    with LLMEngine(config) as engine:
        run = run_passes(engine, args.batch, mixed_batch, args.prompt_len, num_steps, num_requests,
                         output_len, fill_rows, fill_threads, device)
    print_tables(args, description, num_steps, run, num_requests, output_len)


def print_tables(args: argparse.Namespace, description: str, num_steps: int, run: StructuredRun,
                 num_requests: int, output_len: int) -> None:
    free, constrained, probed_pass, probes = run.free, run.constrained, run.probed, run.probes
    mixed_free, mixed, free_tps, constrained_tps, fills = (run.mixed_free, run.mixed, run.free_tps,
                                                           run.constrained_tps, run.fills)
    n = len(probed_pass.step_s)
    pick, fill, apply, accept = (getattr(probes, k) / n * 1e3 for k in ("pick", "fill", "apply", "accept"))
    hidden = probes.num_hidden / max(1, probes.num_fills)
    exposed_fill = fill * (1 - hidden) if args.device.startswith("cuda") else fill
    base = free.mean_ms
    print(f"\nmodel: {description}; device {args.device}; {num_steps} timed decode steps per pass; "
          f"{available_cores()} cores; torch {torch.__version__}; async scheduling {args.async_scheduling}")
    print("\n| measure | ms per step | of the unconstrained step | target |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| (a) unconstrained decode step, batch {args.batch} | {base:.2f} | 100% | |")
    print(f"| (b) constrained decode step (every row under the schema) | {constrained.mean_ms:.2f} | "
          f"{constrained.mean_ms / base:.1%} | <= 110% |")
    print(f"| grammar time left on the critical path, (b) - (a) | {constrained.mean_ms - base:.2f} | "
          f"{(constrained.mean_ms - base) / base:.1%} | <= 0.5 ms |")
    print(f"| (c) parts: pick the constrained rows (schedule) | {pick:.3f} | {pick / base:.1%} | |")
    print(f"| (c) parts: fill the bitmask ({args.batch} rows, host; hidden behind the forward in "
          f"{hidden:.0%} of steps) | {fill:.3f} | {fill / base:.1%} | |")
    print(f"| (c) parts: apply it to the logits ({args.device}, synchronised) | {apply:.3f} | "
          f"{apply / base:.1%} | |")
    print(f"| (c) parts: matchers accept the tokens | {accept:.3f} | {accept / base:.1%} | |")
    critical = pick + exposed_fill + apply + accept
    print(f"| (c) parts on the critical path (pick + unhidden fill + apply + accept) | {critical:.3f} | "
          f"{critical / base:.1%} | <= 0.5 ms |")
    print(f"| (d) unconstrained decode step, batch {args.mixed_batch} | {mixed_free.mean_ms:.2f} | 100% | |")
    print(f"| (e) the same rows, a quarter constrained | {mixed.mean_ms:.2f} | "
          f"{mixed.mean_ms / mixed_free.mean_ms:.1%} | <= 105% |")
    print(f"\nthroughput, {num_requests} requests x {output_len} output tokens (prompts of random length):")
    print("\n| workload | output tok/s | of unconstrained | target |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| unconstrained | {free_tps:,.0f} | 1.00 | |")
    print(f"| every request under the JSON schema | {constrained_tps:,.0f} | "
          f"{constrained_tps / free_tps:.2f} | >= 0.85 |")
    print("\nbitmask fill, ms (xgrammar's batch matcher; rows walked into their own states):")
    threads = sorted({t for _, t in fills})
    print("\n| rows | " + " | ".join(f"{t} thread{'s' * (t > 1)}" for t in threads) + " |")
    print("| ---: |" + " ---: |" * len(threads))
    for rows in sorted({r for r, _ in fills}):
        print(f"| {rows} | " + " | ".join(f"{fills[rows, t]:.3f}" for t in threads) + " |")


if __name__ == "__main__":
    main()
