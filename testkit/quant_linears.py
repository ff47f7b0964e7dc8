"""One linear at a time: the FP8 products against bf16 at Llama-3-8B's four shapes (the table of
`scripts/bench_quant.py --linears`).

On CUDA each figure is a CUDA-graph replay (GPU time only, as the steps run) of one call per
weight copy, in us per call: the copies span twice the L2 cache, so the weights stream from HBM
as in a decode step over 32 layers (an H200's L2 holds a whole qkv weight in e4m3). Columns:
bf16 `F.linear`; the FP8 layer as it serves (the product fp8_tuning.py measured and chose, the
activation quant included, unfused); the w8a16 kernel at its fastest config; quant + `_scaled_mm`;
the weight-bytes floor at the device's measured copy rate and how close the served layer gets to
it; the served layer eager (launch costs included). Under --smoke on a CPU (set TRITON_INTERPRET=1
for the Triton columns) the shapes are divided by 16 and the figures check the code only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from workers.layers import fp8_gemm, fp8_tuning, triton_quant
from workers.layers.quantization import METHODS

# name -> (out_features, in_features) of Llama-3-8B at TP=1
SHAPES = {"qkv 4096->6144": (6144, 4096), "o 4096->4096": (4096, 4096),
          "gate_up 4096->28672": (28672, 4096), "down 14336->4096": (4096, 14336)}
TOKEN_COUNTS = (1, 16, 64, 128, 256, 512, 2048)
EAGER_CALLS = 100
CPU_COPY_BYTES_PER_S = 4.27e12  # the H200's measured rate, for the smoke run's floor column


def copy_rate(device: torch.device) -> float:
    """Device-to-device bytes per second (read + write) of a 512 MiB copy: the floor's rate."""
    if device.type != "cuda":
        return CPU_COPY_BYTES_PER_S
    src = torch.empty(512 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = fp8_tuning.time_us(lambda: dst.copy_(src), device) / 1e6
    return 2 * src.numel() / seconds


def eager_us(fn: Callable[[], object], device: torch.device) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(EAGER_CALLS):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / EAGER_CALLS * 1e6


def _copies(nbytes: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, -(-fp8_tuning.L2_COPIES * l2 // nbytes))


def _each(fn: Callable[[object], object], weights: list) -> Callable[[], None]:
    """One call of fn per weight copy: what a graph replays, as a step calls every layer."""
    def calls() -> None:
        for w in weights:
            fn(w)
    return calls


def linear_rows(name: str, out_features: int, in_features: int, token_counts: tuple[int, ...],
                device: torch.device, rate: float, gen: torch.Generator) -> list[dict[str, object]]:
    fp8 = METHODS["fp8"]
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.02).to(device, torch.bfloat16)
    w8, scale = fp8.quantize_rows(weight)
    bf16_weights = [weight] + [weight.clone() for _ in range(_copies(weight.numel() * 2, device) - 1)]
    fp8_weights = [(w8, scale)] + [(w8.clone(), scale.clone())
                                   for _ in range(_copies(w8.numel(), device) - 1)]
    for w, s in fp8_weights:
        fp8_tuning.register(w, s)  # the served layer's choice is measured over these copies
    rows = []
    for m in token_counts:
        x = torch.randn(m, in_features, generator=gen).to(device, torch.bfloat16)
        rows.append({"shape": name, "M": m, **_timings(x, bf16_weights, fp8_weights, device)})
        rows[-1]["floor"] = w8.numel() / rate * 1e6
        rows[-1]["% of floor"] = 100 * rows[-1]["floor"] / rows[-1]["fp8 served"]
    return rows


def _timings(x: torch.Tensor, bf16_weights: list[torch.Tensor],
             fp8_weights: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> dict[str, object]:
    """One row's figures for activations x [M, K] (us per call)."""
    fp8 = METHODS["fp8"]
    m = x.shape[0]
    w8, scale = fp8_weights[0]
    row: dict[str, object] = {}
    bf16 = _each(lambda w: F.linear(x, w), bf16_weights)
    row["bf16"] = fp8_tuning.time_us(bf16, device) / len(bf16_weights)
    served = _each(lambda ws: fp8.linear(x, ws[0], ws[1]), fp8_weights)
    row["fp8 served"] = fp8_tuning.time_us(served, device) / len(fp8_weights)
    choice = fp8_tuning.choice_for(w8, m, x.dtype)
    row["chosen"] = choice.path if choice else ("scaled_mm" if device.type == "cuda" else "torch (CPU)")
    triton_runs = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if triton_runs and m <= fp8_tuning.MAX_TUNED_M:
        tuned = choice or fp8_tuning.tune_shape(fp8_weights, m, device, x.dtype)
        row["w8a16"] = f"{tuned.w8a16_us:.1f} ({tuned.config.label()})"
        row["quant + scaled_mm"] = tuned.scaled_mm_us
        row["quant + w8a8"] = (f"{tuned.w8a8_us:.1f} ({tuned.w8a8_config.label()})"
                               if tuned.w8a8_config is not None else "-")
    elif triton_runs:
        quant_mm = _each(lambda ws: fp8_gemm.scaled_mm(triton_quant.per_token_quant(x), ws[0], ws[1]),
                         fp8_weights)
        row["quant + scaled_mm"] = fp8_tuning.time_us(quant_mm, device) / len(fp8_weights)
    row["fp8 eager"] = eager_us(lambda: fp8.linear(x, w8, scale), device)
    return row


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if value < 10 else f"{value:.1f}"
    return str(value)


COLUMNS = ("shape", "M", "bf16", "fp8 served", "vs bf16", "chosen", "w8a16", "quant + scaled_mm",
           "quant + w8a8", "floor", "% of floor", "fp8 eager")


def linear_table(device: torch.device, *, smoke: bool) -> list[str]:
    """The markdown table: one row per (shape, M), us per call."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    rate = copy_rate(device)
    shrink = 16 if smoke else 1  # the smoke run checks the code, on small shapes
    token_counts = (1, 16, 64) if smoke else TOKEN_COUNTS
    rows = []
    for name, (out_features, in_features) in SHAPES.items():
        rows += linear_rows(name, out_features // shrink, in_features // shrink, token_counts, device, rate,
                            gen)
    for row in rows:
        row["vs bf16"] = f"{float(row['fp8 served']) / float(row['bf16']):.2f}x"
    kind = "CUDA-graph replays, weights streamed from HBM" if device.type == "cuda" else "CPU"
    lines = [f"per-linear us per call ({kind}{', SMOKE: every shape / 16' if smoke else ''}; floor: fp8 "
             f"weight bytes at the measured copy rate {rate / 1e12:.2f} TB/s; 'fp8 served' = the chosen "
             "product, activation quant included)",
             "| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    for row in rows:
        cells = [row.get(c, "-") for c in COLUMNS]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines
