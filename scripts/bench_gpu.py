"""GPU throughput: tokenfleet's engine against transformers on one GPU, in one run.

    python3 scripts/bench_gpu.py                        # H200: Llama-3-8B shape, 500 requests, ~6 min
    python3 scripts/bench_gpu.py --smoke --device cpu   # tiny model and workload: checks the script anywhere

Builds a Llama-3-8B-shaped model (8.03 B parameters) with random bf16 weights (normal, std
0.02; norms 1) with transformers on the device, saves it as safetensors and loads it with
tokenfleet's own loader. Workload, drawn with random.Random(0): 500 requests, each a prompt
of lognormal length (mean 200, sigma 0.9, clipped to 8..1024) of random token ids, then an
output length (mean 180, sigma 0.8, clipped to 8..512); greedy, EOS ignored, all submitted at
once. Measured in the same run:
- the device's copy bandwidth (device-to-device copy of a 4 GB tensor, bytes read + written)
  and bf16 matmul rate (8192^3), which give the roofline of the workload;
- (a) tokenfleet's engine: output and total tokens/s, and its batch-1 decode latency
  (128-token prompt, 128 output tokens) against the bandwidth floor (weight bytes / bandwidth);
- (b) transformers `generate` in static padded batches of 64, time-bounded (--hf-static-seconds):
  no batch starts that would end past the bound; the rate is over the batches that finished;
- (c) transformers' continuous batching (its continuous-batching manager), on the first
  --hf-cb-requests requests, stopped at --hf-cb-seconds; the rate is over finished requests.

Roofline (docs/perf-notes.md): compute floor = 2 x parameters x (prompt + output tokens) /
matmul rate; memory floor = the weights streamed once per decode step, for at least
max(longest output, output tokens / max_num_seqs) steps, plus every decode's read of its cached
K/V, at the copy bandwidth; the roofline is the larger of the two.

Prints the command line first and one markdown table last; a measurement that fails prints a
row saying so and never stops the others.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import torch

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.logging import configure_logging
from testkit.engine_runs import engine_decode_latency, run_engine_workload, warm_up
from testkit.hf_baseline import HfRun, hf_decode_latency, run_hf_continuous, run_hf_static
from testkit.random_models import LLAMA3_8B, TINY_LLAMA, checkpoint_folder, module_bytes, random_llama
from testkit.roofline import (
    ModelShape,
    Roofline,
    cached_tokens_read,
    copy_bandwidth,
    dense_flops,
    matmul_rate,
    roofline,
)
from testkit.runs import T0, Interrupted, log, print_command, stop_on_sigterm
from testkit.workloads import Workload, sharegpt_workload


def roofline_notes(roof: Roofline, num_params: int, num_tokens: int, weight_bytes: int, kv_read_bytes: int,
                   flops: float, bandwidth: float) -> str:
    return (f"compute floor {roof.compute_s:.2f} s (2 x {num_params / 1e9:.2f} B params x {num_tokens:,} "
            f"tokens at {flops / 1e12:,.0f} TFLOP/s); memory floor {roof.memory_s:.2f} s "
            f"({roof.num_steps} steps x {weight_bytes / 1e9:.1f} GB of weights + "
            f"{kv_read_bytes / 1e9:.0f} GB of K/V reads at {bandwidth / 1e9:,.0f} GB/s)")


# -- the table ---------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    output_rate: float | None = None  # tokens/s
    total_rate: float | None = None
    seconds: float | None = None
    of_roofline: str = "-"
    notes: str = ""


def failed_row(name: str, exc: BaseException) -> Row:
    traceback.print_exc()
    first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
    return Row(name, notes=f"FAILED: {type(exc).__name__}: {first_line}")


def print_table(rows: list[Row], caption: str) -> None:
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    print(f"\n{caption}\n")
    print("| measurement | output tok/s | total tok/s | seconds | of roofline | notes |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r.name} | {num(r.output_rate, ',.0f')} | {num(r.total_rate, ',.0f')} | "
              f"{num(r.seconds, '.1f')} | {r.of_roofline} | {r.notes} |")


# -- (a) tokenfleet -------------------------------------------------------------------------


def engine_row(engine: LLMEngine, workload: Workload, seconds_limit: float, device: torch.device) -> Row:
    """All requests at once; stepped until done or until the time limit (then partial)."""
    run = run_engine_workload(engine, workload, seconds_limit, device)
    return Row("(a) tokenfleet engine", run.output_rate, run.total_rate, run.seconds, notes=run.notes)


# -- (b), (c) transformers -----------------------------------------------------------------


def hf_row(name: str, run: HfRun) -> Row:
    return Row(name, run.output_rate, run.total_rate, run.seconds, notes=run.notes)


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny model and workload (checks the script)")
    parser.add_argument("--num-requests", type=int, help="default 500 (24 with --smoke)")
    parser.add_argument("--max-num-seqs", type=lambda text: [int(v) for v in text.split(",")], default=[512],
                        help="cap on running sequences (and the largest CUDA graph); a comma list runs the "
                             "engine once per value, on the same checkpoint")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run every engine step eagerly")
    parser.add_argument("--engine-seconds", type=float, default=240.0, help="time limit of the engine run")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--hf-static-seconds", type=float, default=90.0)
    parser.add_argument("--hf-cb-requests", type=int, default=300,
                        help="continuous batching runs the first N requests")
    parser.add_argument("--hf-cb-seconds", type=float, default=100.0)
    for name in ("engine", "engine-latency", "hf-static", "hf-latency", "hf-cb"):
        parser.add_argument(f"--skip-{name}", action="store_true")
    parser.add_argument("--keep-checkpoint", action="store_true", help="do not delete the saved model")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print_command()
    configure_logging("WARNING")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available here; use --device cpu --smoke to check the script")
    import transformers

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, {where}")
    shape = TINY_LLAMA if args.smoke else LLAMA3_8B
    num_requests = args.num_requests or (24 if args.smoke else 500)
    workload = sharegpt_workload(num_requests, shape["vocab_size"], prompt_max=200 if args.smoke else 1024,
                                 output_max=48 if args.smoke else 512)
    log(f"workload: {num_requests} requests, {workload.num_prompt_tokens:,} prompt + "
        f"{workload.num_output_tokens:,} output tokens")
    rows: list[Row] = []
    bandwidth = copy_bandwidth(device, (256 << 20) if args.smoke else (4 << 30))
    flops = matmul_rate(device, torch.bfloat16, 1024 if args.smoke else 8192)
    log(f"copy bandwidth {bandwidth / 1e9:,.0f} GB/s, bf16 matmul {flops / 1e12:,.1f} TFLOP/s")
    rows.append(Row("device copy bandwidth", notes=f"{bandwidth / 1e9:,.0f} GB/s (device-to-device copy of "
                    f"{'256 MB' if args.smoke else '4 GB'}, bytes read + written)"))
    rows.append(Row("device bf16 matmul", notes=f"{flops / 1e12:,.1f} TFLOP/s "
                    f"({'1024' if args.smoke else '8192'}^3, random data)"))
    stop_on_sigterm()
    try:
        run_all(args, shape, workload, device, bandwidth, flops, rows)
    except Interrupted:
        rows.append(Row("INTERRUPTED", notes=f"SIGTERM after {time.perf_counter() - T0:.0f} s: the rows "
                        "above are what finished"))
    except Exception as exc:  # noqa: BLE001 - whatever broke, the rows so far are printed
        rows.append(failed_row("building or saving the model", exc))
    num_params = ModelShape.of(shape).num_params
    ours = next((r for r in rows if r.name.startswith("(a)") and r.output_rate), None)
    cb = next((r for r in rows if r.name.startswith("(c)") and r.output_rate), None)
    if ours and cb:
        ours.notes += f"; {ours.output_rate / cb.output_rate:.1f}x transformers' continuous batching"
    log("done")
    caption = (f"{where}, Llama-3-8B shape ({num_params / 1e9:.2f} B params, bf16), {num_requests} requests "
               f"({workload.num_prompt_tokens:,} prompt + {workload.num_output_tokens:,} output tokens)")
    print_table(rows, f"SMOKE RUN on {where}: tiny model, not a measurement" if args.smoke else caption)


def run_all(args, shape: dict, workload: Workload, device: torch.device, bandwidth: float, flops: float,
            rows: list[Row]) -> None:
    """Build and save the model, then measure every system; rows as they finish."""
    model = random_llama(shape, device)
    num_params = sum(p.numel() for p in model.parameters())
    weight_bytes = module_bytes(model)
    folder = checkpoint_folder(weight_bytes)
    try:
        model.save_pretrained(folder)
        log(f"model: {num_params / 1e9:.3f} B parameters, {weight_bytes / 1e9:.2f} GB, saved to {folder}")
        kv_bytes_per_token = ModelShape.of(shape).kv_bytes_per_token(2)  # bf16
        roof = roofline(dense_flops(num_params, workload), weight_bytes, kv_bytes_per_token, workload,
                        flop_rate=flops, bandwidth=bandwidth, max_num_seqs=args.max_num_seqs[0])
        roof_rate = workload.num_output_tokens / roof.seconds
        num_tokens = workload.num_prompt_tokens + workload.num_output_tokens
        notes = roofline_notes(roof, num_params, num_tokens, weight_bytes,
                               cached_tokens_read(workload) * kv_bytes_per_token, flops, bandwidth)
        rows.append(Row("roofline of this workload", roof_rate, num_tokens / roof.seconds, roof.seconds,
                        "100%", notes))
        floor_s = weight_bytes / bandwidth
        rows.extend(run_ours(args, folder, workload, device, roof_rate, floor_s, shape["vocab_size"]))
        rows.extend(run_transformers(args, model, workload, device, roof_rate, floor_s, shape["vocab_size"]))
    finally:
        if not args.keep_checkpoint:
            shutil.rmtree(folder, ignore_errors=True)


def run_ours(args, folder: Path, workload: Workload, device: torch.device, roof_rate: float,
             floor_s: float, vocab_size: int) -> list[Row]:
    if args.skip_engine:
        return []
    rows = []
    for i, max_num_seqs in enumerate(args.max_num_seqs):
        rows += run_engine_config(args, max_num_seqs, folder, workload, device, roof_rate, floor_s,
                                  vocab_size, measure_latency=i == 0 and not args.skip_engine_latency)
    return rows


def run_engine_config(args, max_num_seqs: int, folder: Path, workload: Workload, device: torch.device,
                      roof_rate: float, floor_s: float, vocab_size: int, *,
                      measure_latency: bool) -> list[Row]:
    rows = []
    engine = None
    try:
        # for_device: the device's defaults for the rest (async scheduling on CUDA), as the commands'.
        config = EngineConfig.for_device(device.type, model=str(folder), device=args.device, dtype="bfloat16",
                                         max_num_seqs=max_num_seqs, cuda_graph_max_batch_size=max_num_seqs,
                                         max_num_batched_tokens=args.max_num_batched_tokens,
                                         cuda_graphs=not args.no_cuda_graphs)
        engine = LLMEngine(config, load_tokenizer_files=False)
        graphs = getattr(engine.executor.runner, "decode_graphs", None)
        log(f"engine loaded (max_num_seqs {max_num_seqs}): {engine.executor.num_kv_blocks} KV blocks, CUDA "
            f"graphs {'up to batch ' + str(graphs.sizes[-1]) if graphs else 'off'}")
        warm_up(engine, vocab_size)
        row = engine_row(engine, workload, args.engine_seconds, device)
        row.of_roofline = f"{row.output_rate / roof_rate:.1%}"
        if len(args.max_num_seqs) > 1:
            row.name += f", max_num_seqs {max_num_seqs}"
        row.notes = f"max_num_seqs {max_num_seqs}; " + row.notes
        rows.append(row)
        log(f"engine (max_num_seqs {max_num_seqs}): {row.output_rate:,.0f} output tok/s")
    except Exception as exc:  # noqa: BLE001 - a failed measurement is a row, not the end of the table
        rows.append(failed_row(f"(a) tokenfleet engine, max_num_seqs {max_num_seqs}", exc))
    if engine is not None and measure_latency:
        try:
            seconds = engine_decode_latency(engine, vocab_size, device)
            notes = (f"{seconds * 1e3:.2f} ms/token (128 prompt, 128 output tokens) vs bandwidth floor "
                     f"{floor_s * 1e3:.2f} ms: {seconds / floor_s:.2f}x the floor")
            rows.append(Row("(a) tokenfleet batch-1 decode", 1 / seconds,
                            of_roofline=f"{floor_s / seconds:.1%}", notes=notes))
            log(f"engine batch-1: {seconds * 1e3:.2f} ms/token")
        except Exception as exc:  # noqa: BLE001
            rows.append(failed_row("(a) tokenfleet batch-1 decode", exc))
    if engine is not None:
        engine.close()
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def run_transformers(args, model, workload: Workload, device: torch.device, roof_rate: float,
                     floor_s: float, vocab_size: int) -> list[Row]:
    rows = []
    if not args.skip_hf_static:
        try:
            row = hf_row("(b) transformers generate, static batches",
                         run_hf_static(model, workload, args.hf_batch_size, args.hf_static_seconds, device))
            row.of_roofline = f"{row.output_rate / roof_rate:.1%}"
            rows.append(row)
            log(f"transformers static: {row.output_rate:,.0f} output tok/s")
        except Exception as exc:  # noqa: BLE001
            rows.append(failed_row("(b) transformers generate, static batches", exc))
    if not args.skip_hf_latency:
        try:
            seconds = hf_decode_latency(model, vocab_size, device)
            notes = (f"{seconds * 1e3:.2f} ms/token (128 prompt, 32 output tokens): "
                     f"{seconds / floor_s:.1f}x the floor")
            rows.append(Row("(b) transformers batch-1 decode", 1 / seconds,
                            of_roofline=f"{floor_s / seconds:.1%}", notes=notes))
        except Exception as exc:  # noqa: BLE001
            rows.append(failed_row("(b) transformers batch-1 decode", exc))
    if not args.skip_hf_cb:
        try:
            run = run_hf_continuous(model, workload.head(args.hf_cb_requests), args.hf_cb_seconds, device)
            row = hf_row("(c) transformers continuous batching", run)
            row.of_roofline = f"{row.output_rate / roof_rate:.1%}"
            rows.append(row)
            log(f"transformers continuous batching: {row.output_rate:,.0f} output tok/s")
        except Exception as exc:  # noqa: BLE001
            rows.append(failed_row("(c) transformers continuous batching", exc))
    return rows


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
