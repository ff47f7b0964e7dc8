"""One linear at a time: every FP8 product candidate against bf16 at Llama-3-8B's four shapes
(the table of `scripts/bench_quant.py --linears`). On CUDA each figure is a CUDA-graph replay of
REPS calls (GPU time only, as the steps run), in us per call; the last columns are the layer as
it serves (graph and eager, quant included) and the weight-bytes floor at the device's copy rate.
What the table picks goes into workers/layers/fp8_gemm.py (SMALL_M_MAX and the w8a16 config).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from workers.layers import fp8_gemm, triton_quant
from workers.layers.fp8 import quantize_activation
from workers.layers.quantization import METHODS

# name -> (out_features, in_features) of Llama-3-8B at TP=1
SHAPES = {"qkv 4096->6144": (6144, 4096), "o 4096->4096": (4096, 4096),
          "gate_up 4096->28672": (28672, 4096), "down 14336->4096": (4096, 14336)}
TOKEN_COUNTS = (1, 16, 64, 256, 2048)
REPS = 20  # calls per graph
# (block_n, block_k, num_warps, num_stages) tried for the w8a16 kernel, besides the default.
W8A16_CONFIGS = ((32, 256, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4), (16, 512, 4, 4))
W8A16_MAX_M = 256  # beyond this the weight-only kernel is a plain (slow) Triton GEMM
COPY_BYTES_PER_S = 4.2e12  # H200 device-to-device, NOTES.md; the floor column reads weights once


def time_us(fn: Callable[[], object], device: torch.device, *, graph: bool) -> float:
    """us per call: a replayed graph of REPS calls (best of 5 replays), or eager calls."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(REPS):
            fn()
        return (time.perf_counter() - start) / REPS * 1e6
    torch.cuda.synchronize()
    if not graph:
        start = time.perf_counter()
        for _ in range(REPS * 5):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / (REPS * 5) * 1e6
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm the side stream as capture requires
        fn()
    torch.cuda.synchronize()
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        for _ in range(REPS):
            fn()
    best = float("inf")
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        cuda_graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, begin.elapsed_time(end) * 1e3 / REPS)
    del cuda_graph
    return best


def candidates(x: torch.Tensor, weight: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
               ) -> dict[str, Callable[[], object]]:
    """name -> a call; the CUDA-only ones (Triton kernels, fast accumulation) only on CUDA."""
    fp8 = METHODS["fp8"]
    xq = quantize_activation(x)
    ones = torch.ones((), dtype=torch.float32, device=x.device)
    found: dict[str, Callable[[], object]] = {
        "bf16 F.linear": lambda: F.linear(x, weight),
        "quant, torch ops (before)": lambda: quantize_activation(x),
        "_scaled_mm rowwise": lambda: fp8_gemm.scaled_mm(xq, w8, scale, use_fast_accum=False),
    }
    if x.is_cuda:
        m = x.shape[0]
        found["quant, Triton kernel"] = lambda: triton_quant.per_token_quant(x)
        found["_scaled_mm rowwise fast"] = lambda: fp8_gemm.scaled_mm(xq, w8, scale)
        found["_scaled_mm tensorwise fast"] = lambda: torch._scaled_mm(
            xq.data, w8.t(), scale_a=ones, scale_b=ones, out_dtype=x.dtype, use_fast_accum=True)
        if m <= W8A16_MAX_M:
            found["w8a16 default"] = lambda: fp8_gemm.w8a16(x, w8, scale)
            for bn, bk, warps, stages in W8A16_CONFIGS:
                found[f"w8a16 n{bn} k{bk} w{warps} s{stages}"] = (
                    lambda bn=bn, bk=bk, warps=warps, stages=stages: fp8_gemm.w8a16(
                        x, w8, scale, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages))
            found["w8a16 default, no split-K"] = lambda: fp8_gemm.w8a16(x, w8, scale, split_k=1)
    found["fp8 layer as served"] = lambda: fp8.linear(x, w8, scale)
    return found


def linear_table(device: torch.device, *, smoke: bool) -> list[str]:
    """The markdown table: one row per (shape, M), one column per candidate (us per call)."""
    fp8 = METHODS["fp8"]
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows: list[dict[str, float]] = []
    labels: list[tuple[str, int]] = []
    shrink = 16 if smoke else 1  # the smoke run checks the code, on small shapes
    token_counts = (1, 16, 64) if smoke else TOKEN_COUNTS
    for name, (out_features, in_features) in SHAPES.items():
        out_features, in_features = out_features // shrink, in_features // shrink
        weight = (torch.randn(out_features, in_features, generator=gen) * 0.02).to(device, torch.bfloat16)
        w8, scale = fp8.quantize_rows(weight)
        for m in token_counts:
            x = torch.randn(m, in_features, generator=gen).to(device, torch.bfloat16)
            calls = candidates(x, weight, w8, scale)
            times = {label: time_us(fn, device, graph=True) for label, fn in calls.items()}
            times["fp8 layer, eager"] = time_us(calls["fp8 layer as served"], device, graph=False)
            times["weight floor (fp8 bytes)"] = w8.numel() / COPY_BYTES_PER_S * 1e6
            rows.append(times)
            labels.append((name, m))
    columns = list(dict.fromkeys(c for r in rows for c in r))
    lines = [f"per-linear us per call ({'CUDA-graph replays' if device.type == 'cuda' else 'CPU, eager'}"
             f"{', SMOKE: every shape / 16' if smoke else ''}; "
             f"layer picks w8a16 up to M = {fp8_gemm.SMALL_M_MAX}, then _scaled_mm with fast accumulation)",
             "| shape | M | " + " | ".join(columns) + " | fastest fp8 product |",
             "|---|---:|" + "---:|" * len(columns) + "---|"]
    # Tensor-wise scales would drop the per-channel weight scales: timed for reference, never picked.
    products = [c for c in columns if c.startswith(("_scaled_mm", "w8a16")) and "tensorwise" not in c]
    for (name, m), times in zip(labels, rows, strict=True):
        cells = " | ".join(f"{times[c]:.1f}" if c in times else "-" for c in columns)
        fastest = min((c for c in products if c in times), key=lambda c: times[c], default="-")
        lines.append(f"| {name} | {m} | {cells} | {fastest} |")
    return lines
