"""Offline throughput: tokenfleet's engine against transformers `generate`, same run, same CPU.

    .venv/bin/python scripts/bench_engine.py                      # float32, 128 requests
    .venv/bin/python scripts/bench_engine.py --dtype bfloat16
    .venv/bin/python scripts/bench_engine.py --skip-hf            # iterate on our engine
    .venv/bin/python scripts/bench_engine.py --hf-subset 2        # baseline from 2 batches

Workload: `--num-requests` requests drawn with random.Random(0): prompts of 32-512 random
token ids (from [3, vocab), clear of the special ids), 16-256 output tokens each, EOS
ignored, greedy. Both systems must produce exactly each request's max_tokens; only those
"useful" output tokens count (transformers' padded batches make more, which it pays for).

Alongside: the CPU's matrix rate measured now, with the same threads, and the compute
floor of the workload at that rate, so each system's figure reads as a fraction of what
the hardware allows. Prints the command line first and a README-ready table last.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import torch

from shared.config import EngineConfig
from shared.logging import configure_logging
from shared.model_config import load_model_config
from testkit.cpu_engine_runs import Measurement, measure_rates, run_engine, run_transformers
from testkit.roofline import ModelShape, exact_flops, roofline
from testkit.runs import print_command
from testkit.workloads import Workload, uniform_workload
from workers.device import DTYPES

# Below this share of the cores, something else ran during the measurement: say so. Quiet
# runs get 99%; at 87% a run was seen 38% slower (threads wait on the one descheduled).
MIN_CPU_SHARE = 0.95


# -- the report -------------------------------------------------------------------


def print_table(
    floors: dict[str, float], workload: Workload, measurements: list[Measurement], caption: str
) -> None:
    """One row per floor (name -> seconds) and per system; fractions are of the compute floor."""
    floor_seconds = floors["compute floor"]
    num_total = workload.num_prompt_tokens + workload.num_output_tokens
    rows = [
        (name, seconds, workload.num_output_tokens / seconds, num_total / seconds, "",
         f"{floor_seconds / seconds:.3f}")
        for name, seconds in floors.items()
    ]
    baseline = next((m for m in measurements if m.name.startswith("transformers")), None)
    for m in measurements:
        ratio = f"{m.output_rate / baseline.output_rate:.2f}x" if baseline else "-"
        fraction = f"{floor_seconds / m.seconds:.3f}"
        rows.append((m.name, m.seconds, m.output_rate, m.total_rate, ratio, fraction))
    header = ("system", "wall s", "output tok/s", "total tok/s", "vs transformers", "of floor")
    print(f"\n{header[0]:<38} {header[1]:>8} {header[2]:>13} {header[3]:>12} {header[4]:>16} {header[5]:>9}")
    for name, seconds, out_rate, total_rate, ratio, fraction in rows:
        print(f"{name:<38} {seconds:>8.1f} {out_rate:>13.1f} {total_rate:>12.1f} {ratio:>16} {fraction:>9}")
    for m in measurements:
        print(f"  {m.name}: {m.note + '; ' if m.note else ''}got {m.cpu_share:.0%} of "
              f"{torch.get_num_threads()} cores")
        if m.cpu_share < MIN_CPU_SHARE:
            print(f"  WARNING: {m.name} got only {m.cpu_share:.0%} of the cores: another process "
                  "competed for them; re-run on a quiet machine before quoting this figure")

    disturbed = [m.name for m in measurements if m.cpu_share < MIN_CPU_SHARE]
    if disturbed:
        caption += f"; NOT QUOTABLE: {', '.join(disturbed)} shared the cores"
    print(f"\nMarkdown ({caption}):\n")
    print("| system | wall s | useful output tok/s | total tok/s | vs transformers | of compute floor |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, seconds, out_rate, total_rate, ratio, fraction in rows:
        print(f"| {name} | {seconds:.1f} | {out_rate:.1f} | {total_rate:.1f} | {ratio or '-'} | {fraction} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--skip-hf", action="store_true", help="run only tokenfleet's engine")
    parser.add_argument("--hf-subset", type=int, metavar="N",
                        help="run transformers on the first N batches only and extrapolate")
    parser.add_argument("--max-num-seqs", type=int, help="engine's cap on running sequences")
    parser.add_argument("--max-num-batched-tokens", type=int, help="engine's per-step token budget")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging("WARNING")
    print_command()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from workers.default_model import fetch_default_model

        args.model = str(fetch_default_model())
    cfg = load_model_config(args.model)
    workload = uniform_workload(args.num_requests, cfg.vocab_size, prompt_lens=(32, 512),
                                output_lens=(16, 256))
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} cpus; model {args.model}")
    print(f"workload: {args.num_requests} requests, {workload.num_prompt_tokens} prompt + "
          f"{workload.num_output_tokens} output tokens, greedy, EOS ignored, dtype {args.dtype}")

    rates_before = measure_rates(args.dtype, "before")
    shape = ModelShape.of(cfg)
    linear_flops, attention_flops = exact_flops(shape, workload)
    num_layer_params = shape.num_layers * shape.layer_matrix_params
    num_head_params = shape.vocab_size * shape.hidden_size
    element_size = torch.tensor([], dtype=DTYPES[args.dtype]).element_size()
    weight_bytes = (num_layer_params + num_head_params) * element_size  # embeddings are lookups
    print(f"compute floor: {num_layer_params / 1e6:.1f} M layer + {num_head_params / 1e6:.1f} M "
          f"head parameters; {linear_flops / 1e12:.2f} TFLOP linear + "
          f"{attention_flops / 1e12:.2f} TFLOP attention")

    measurements = []
    dtype = DTYPES[args.dtype]
    if not args.skip_hf:
        print("running transformers ...", flush=True)
        measurements.append(run_transformers(args.model, dtype, workload, args.hf_subset))
        gc.collect()  # the transformers model goes before ours loads
    engine_config = EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads)
    if args.max_num_seqs is not None:
        engine_config.max_num_seqs = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        engine_config.max_num_batched_tokens = args.max_num_batched_tokens
    print(f"running tokenfleet (max_num_seqs={engine_config.max_num_seqs}, "
          f"max_num_batched_tokens={engine_config.max_num_batched_tokens}) ...", flush=True)
    measurements.append(run_engine(engine_config, workload))
    rates_after = measure_rates(args.dtype, "after")
    # The higher of the two is the least disturbed, and so the stricter floor.
    rate = max(rates_before[args.dtype], rates_after[args.dtype])
    bandwidth = max(rates_before["read"], rates_after["read"])
    # Every weight read once per step (at least max(max_tokens) steps), and each decode's
    # cached K/V: where this exceeds the compute floor, decoding is bound by memory.
    roof = roofline(linear_flops + attention_flops, weight_bytes, shape.kv_bytes_per_token(element_size),
                    workload, flop_rate=rate, bandwidth=bandwidth)
    floors = {"compute floor": roof.compute_s, "memory floor": roof.memory_s}
    caption = (f"{args.dtype}, {len(workload.prompts)} requests, {torch.get_num_threads()} threads, "
               f"matmul {rate / 1e9:,.0f} GFLOP/s, read {bandwidth / 1e9:.0f} GB/s")
    print_table(floors, workload, measurements, caption)


if __name__ == "__main__":
    main()
