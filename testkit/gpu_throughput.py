"""bench_gpu.py's measurements as table rows: the roofline of the workload, tokenfleet's engine
(per max_num_seqs, and its batch-1 decode against the bandwidth floor) and the transformers
baselines on the same checkpoint. A measurement that fails is a row saying so, never the end of
the table."""

from __future__ import annotations

import argparse
import gc
import shutil
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from testkit.engine_runs import engine_decode_latency, run_engine_workload, warm_up
from testkit.hf_baseline import HfRun, hf_decode_latency, run_hf_continuous, run_hf_static
from testkit.random_models import checkpoint_folder, module_bytes, random_llama
from testkit.roofline import (
    ModelShape,
    Roofline,
    cached_tokens_read,
    copy_bandwidth,
    dense_flops,
    matmul_rate,
    roofline,
)
from testkit.runs import log
from testkit.workloads import Workload
from workers.card_sizing import config_for_device


def roofline_notes(roof: Roofline, num_params: int, num_tokens: int, weight_bytes: int, kv_read_bytes: int,
                   flops: float, bandwidth: float) -> str:
    return (f"compute floor {roof.compute_s:.2f} s (2 x {num_params / 1e9:.2f} B params x {num_tokens:,} "
            f"tokens at {flops / 1e12:,.0f} TFLOP/s); memory floor {roof.memory_s:.2f} s "
            f"({roof.num_steps} steps x {weight_bytes / 1e9:.1f} GB of weights + "
            f"{kv_read_bytes / 1e9:.0f} GB of K/V reads at {bandwidth / 1e9:,.0f} GB/s)")


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


# -- (a) tokenfleet -------------------------------------------------------------------------


def engine_row(engine: LLMEngine, workload: Workload, seconds_limit: float, device: torch.device) -> Row:
    """All requests at once; stepped until done or until the time limit (then partial)."""
    run = run_engine_workload(engine, workload, seconds_limit, device)
    return Row("(a) tokenfleet engine", run.output_rate, run.total_rate, run.seconds, notes=run.notes)


# -- (b), (c) transformers -----------------------------------------------------------------


def hf_row(name: str, run: HfRun) -> Row:
    return Row(name, run.output_rate, run.total_rate, run.seconds, notes=run.notes)


def run_all(args: argparse.Namespace, shape: dict, workload: Workload, device: torch.device, bandwidth: float,
            flops: float, rows: list[Row]) -> None:
    """Build and save the model, then measure every system; rows as they finish."""
    model = random_llama(shape, device)
    num_params = sum(p.numel() for p in model.parameters())
    weight_bytes = module_bytes(model)
    folder = checkpoint_folder(weight_bytes)
    try:
        model.save_pretrained(folder)
        log(f"model: {num_params / 1e9:.3f} B parameters, {weight_bytes / 1e9:.2f} GB, saved to {folder}")
        resolve_auto_sizes(args, folder, device)
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


def resolve_auto_sizes(args: argparse.Namespace, folder: Path, device: torch.device) -> None:
    """--max-num-seqs auto (0): the value and the graph cap the commands choose for this card and
    model (workers/card_sizing.py), set in args.max_num_seqs and args.graph_batch."""
    args.graph_batch = {}  # max_num_seqs -> its largest CUDA graph, where not max_num_seqs
    if 0 not in args.max_num_seqs:
        return
    auto = config_for_device(device, model=str(folder), device=args.device, dtype="bfloat16",
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             cuda_graphs=not args.no_cuda_graphs)
    log(f"auto: max_num_seqs {auto.max_num_seqs}, CUDA graphs up to {auto.cuda_graph_max_batch_size}")
    args.max_num_seqs = [n or auto.max_num_seqs for n in args.max_num_seqs]
    args.graph_batch[auto.max_num_seqs] = auto.cuda_graph_max_batch_size


def run_ours(args: argparse.Namespace, folder: Path, workload: Workload, device: torch.device,
             roof_rate: float, floor_s: float, vocab_size: int) -> list[Row]:
    if args.skip_engine:
        return []
    rows = []
    for i, max_num_seqs in enumerate(args.max_num_seqs):
        rows += run_engine_config(args, max_num_seqs, folder, workload, device, roof_rate, floor_s,
                                  vocab_size, measure_latency=i == 0 and not args.skip_engine_latency)
    return rows


def run_engine_config(args: argparse.Namespace, max_num_seqs: int, folder: Path, workload: Workload,
                      device: torch.device, roof_rate: float, floor_s: float, vocab_size: int, *,
                      measure_latency: bool) -> list[Row]:
    rows = []
    engine = None
    try:
        # for_device: the device's defaults for the rest (async scheduling on CUDA), as the commands'.
        config = EngineConfig.for_device(device.type, model=str(folder), device=args.device, dtype="bfloat16",
                                         max_num_seqs=max_num_seqs,
                                         cuda_graph_max_batch_size=getattr(args, "graph_batch", {}).get(
                                             max_num_seqs, max_num_seqs),
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


def run_transformers(args: argparse.Namespace, model: torch.nn.Module, workload: Workload,
                     device: torch.device, roof_rate: float, floor_s: float, vocab_size: int) -> list[Row]:
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


def device_rows(device: torch.device, smoke: bool) -> tuple[float, float, list[Row]]:
    """The device's copy bandwidth and bf16 matmul rate, measured now, and their rows."""
    bandwidth = copy_bandwidth(device, (256 << 20) if smoke else (4 << 30))
    flops = matmul_rate(device, torch.bfloat16, 1024 if smoke else 8192)
    log(f"copy bandwidth {bandwidth / 1e9:,.0f} GB/s, bf16 matmul {flops / 1e12:,.1f} TFLOP/s")
    return bandwidth, flops, [
        Row("device copy bandwidth", notes=f"{bandwidth / 1e9:,.0f} GB/s (device-to-device copy of "
            f"{'256 MB' if smoke else '4 GB'}, bytes read + written)"),
        Row("device bf16 matmul", notes=f"{flops / 1e12:,.1f} TFLOP/s ({'1024' if smoke else '8192'}^3, "
            "random data)")]


def note_against_continuous_batching(rows: list[Row]) -> None:
    """The engine's row says how many times transformers' continuous batching it made."""
    ours = next((r for r in rows if r.name.startswith("(a)") and r.output_rate), None)
    cb = next((r for r in rows if r.name.startswith("(c)") and r.output_rate), None)
    if ours and cb:
        ours.notes += f"; {ours.output_rate / cb.output_rate:.1f}x transformers' continuous batching"
