"""Which FP8 product each linear shape runs at each token count, chosen by timing on this GPU.

For every FP8 weight shape (N, K) of the model and every token-count bucket up to MAX_TUNED_M
(1, 2, 4, ..., 256; a step of M tokens takes the bucket of the next power of two), the first
call times, on the GPU itself:
- every `fp8_gemm.w8a16` config for that M (fp8_gemm.configs_for), keeping the fastest;
- `per_token_quant` + `scaled_mm` (the quant counted in full, though before qkv, gate_up and down
  it is fused into the RMSNorm or SiLU-mul: a small bias towards w8a16);
- from 16 tokens (TRY_W8A8, on by default), `per_token_quant` + every `fp8_gemm.w8a8` config (the quant
  counted likewise);
and keeps the fastest product. A Triton candidate whose output on the first weight disagrees
with the product of the dequantized operands is ruled out like one that fails to compile. Above
MAX_TUNED_M it is always scaled_mm (it is 1.7x bf16 at M = 2048 and the weight-only kernel is a
plain Triton GEMM there).

Each figure is a CUDA-graph replay of one call per layer of that shape, over the model's own
weights (registered as the layers are built): the weights stream from HBM as in a decode step,
not from L2 (an H200's 50 MB L2 holds a whole qkv weight in e4m3). With fewer weights than twice
the L2, copies are made for the timing. The whole table is measured at once, at the first FP8
call with few tokens: the graph capture's warm-up pass (capture_graphs runs each size eagerly
before capturing it), or `tune(model)` before capture. It is logged as one line.

Both the decoder layer (`takes_fp8_input`: should the norm before hand over e4m3 rows?) and the
linear read the same table, so the fused quant and the product always agree.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch

from shared.logging import get_logger
from workers.layers import fp8_gemm, triton_quant
from workers.layers.fp8 import FP8_DTYPE, QuantizedActivation
from workers.layers.fp8_gemm import W8A8Config, W8A16Config

M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# The FP8 x FP8 Triton GEMM as a candidate from 16 tokens. On the H200 it is the fastest product
# at 16-64 tokens for all four Llama-3-8B shapes but gate_up at 64, and for o up to 256 (the
# per-linear table in docs/quantization.md); the 500-request burst went from 1.35x bf16 to
# 1.39-1.40x with it (three runs).
TRY_W8A8 = True
AGREEMENT = 0.05  # a candidate's relative error against the dequantized product, at most
MAX_TUNED_M = M_BUCKETS[-1]
REPLAYS = 3  # best of
L2_COPIES = 2  # the timed weights span at least this many L2 caches

log = get_logger("tokenfleet.fp8_tuning")


class Choice(NamedTuple):
    """The product one (shape, bucket) runs, and what each candidate took (us per call)."""

    path: str  # "w8a16", "scaled_mm" or "w8a8" (the last two take e4m3 activations)
    config: W8A16Config | None  # w8a16's fastest config
    w8a16_us: float
    scaled_mm_us: float
    w8a8_config: W8A8Config | None = None  # w8a8's fastest config (None: not timed at this M)
    w8a8_us: float = float("inf")


# (device index, N, K, bucket) -> the measured choice
_choices: dict[tuple[int, int, int, int], Choice] = {}
# (device index, N, K) -> the FP8 weights (and scales) of that shape, as the layers were built
_weights: dict[tuple[int, int, int], list[tuple[weakref.ref, weakref.ref]]] = {}


def m_bucket(m: int) -> int | None:
    """The bucket whose measurement decides a step of m tokens; None above MAX_TUNED_M."""
    for bucket in M_BUCKETS:
        if m <= bucket:
            return bucket
    return None


def _index(device: torch.device) -> int:
    """The device's key in the tables: its CUDA index (-1: the CPU, tests under the interpreter)."""
    if device.type != "cuda":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def register(weight: torch.Tensor, scale: torch.Tensor) -> None:
    """An FP8 layer's weight [N, K] and scale [N], timed with the others of its shape."""
    if weight.device.type != "cuda" or not fp8_gemm.is_aligned(weight):
        return  # unaligned layers multiply a dequantized weight: nothing to choose
    key = (_index(weight.device), *weight.shape)
    _weights.setdefault(key, []).append((weakref.ref(weight), weakref.ref(scale)))


def _registered(key: tuple[int, int, int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    alive = [(w(), s()) for w, s in _weights.get(key, [])]
    alive = [(w, s) for w, s in alive if w is not None and s is not None]
    _weights[key] = [(weakref.ref(w), weakref.ref(s)) for w, s in alive]
    return alive


def uses_w8a16(weight: torch.Tensor, num_tokens: int, dtype: torch.dtype) -> bool:
    """Whether a step of num_tokens (activations in dtype) multiplies by weight (e4m3 [N, K] on
    CUDA) in w8a16 rather than in scaled_mm."""
    choice = choice_for(weight, num_tokens, dtype)
    return choice is not None and choice.path == "w8a16"


def choice_for(weight: torch.Tensor, num_tokens: int, dtype: torch.dtype) -> Choice | None:
    """The measured product for this shape at num_tokens; None: scaled_mm (above the buckets,
    or no Triton). Measures the whole table first if this shape or bucket was never timed."""
    bucket = m_bucket(num_tokens)
    if (bucket is None or fp8_gemm.triton is None or weight.device.type != "cuda"
            or not fp8_gemm.is_aligned(weight)):
        return None
    shape = (_index(weight.device), weight.shape[0], weight.shape[1])
    found = _choices.get((*shape, bucket))
    if found is not None:
        return found
    if torch.cuda.is_current_stream_capturing():
        # Never timed before a capture (the capture warms each size up first, so this is a shape
        # met for the first time inside one): fall back to the rule that held before measuring.
        return Choice("w8a16" if bucket <= 16 else "scaled_mm", fp8_gemm.default_config(bucket), 0.0, 0.0)
    # A weight no layer registered (a bare call, as in testkit/quant_linears.py): timed alone.
    extra = {} if _registered(shape) else {shape: [(weight, _unit_scale(weight))]}
    tune_all(weight.device, dtype, extra=extra)
    return _choices[(*shape, bucket)]


def _unit_scale(weight: torch.Tensor) -> torch.Tensor:
    return torch.ones(weight.shape[0], dtype=torch.float32, device=weight.device)


def tune(model: torch.nn.Module, device: torch.device, dtype: torch.dtype = torch.bfloat16,
         max_m: int = MAX_TUNED_M) -> None:
    """Measure the table for every FP8 linear of `model` now (call it before the CUDA graphs are
    captured; otherwise the capture's first warm-up pass does it)."""
    if device.type != "cuda" or fp8_gemm.triton is None:
        return
    for module in model.modules():
        scale = getattr(module, "weight_scale", None)
        weight = getattr(module, "weight", None)
        if scale is not None and weight is not None and weight.dtype == FP8_DTYPE:
            shape = (_index(weight.device), *weight.shape)
            if not any(w is weight for w, _ in _registered(shape)):
                register(weight, scale)
    tune_all(device, dtype, max_m)


Weights = list[tuple[torch.Tensor, torch.Tensor]]  # FP8 weights [N, K] of one shape, with their scales [N]


def tune_all(device: torch.device, dtype: torch.dtype, max_m: int = MAX_TUNED_M, *,
             extra: dict[tuple[int, int, int], Weights] | None = None) -> None:
    """Time every registered shape on `device` (and those of `extra`) at every bucket up to max_m
    not yet measured; one log line with the table."""
    index = _index(device)
    start = time.perf_counter()
    shapes = {shape: _registered(shape) for shape in _weights if shape[0] == index}
    shapes.update(extra or {})
    table = {}
    for shape, weights in shapes.items():
        for bucket in (b for b in M_BUCKETS if b <= max_m and (*shape, b) not in _choices):
            if not weights:
                continue
            choice = tune_shape(weights, bucket, device, dtype)
            _choices[(*shape, bucket)] = choice
            w8a8 = (f", w8a8 {choice.w8a8_us:.1f}us ({choice.w8a8_config.label()})"
                    if choice.w8a8_config is not None else "")
            table[f"{shape[1]}x{shape[2]} M<={bucket}"] = (
                f"{choice.path}: w8a16 {choice.w8a16_us:.1f}us ({choice.config.label()}), "
                f"scaled_mm {choice.scaled_mm_us:.1f}us{w8a8}")
    if table:
        log.info("fp8 products measured", device=str(device), seconds=round(time.perf_counter() - start, 1),
                 table=table)


def tune_shape(weights: list[tuple[torch.Tensor, torch.Tensor]], m: int, device: torch.device,
               dtype: torch.dtype, *, configs: tuple[W8A16Config, ...] | None = None,
               w8a8_configs: tuple[W8A8Config, ...] | None = None) -> Choice:
    """Time every w8a16 config, quant + scaled_mm and quant + every w8a8 config for x [m, K] in
    dtype over `weights` (all [N, K] e4m3 with their [N] scales)."""
    weights = _spanning_l2(weights, device)
    k = weights[0][0].shape[1]
    x = torch.randn(m, k, device=device, dtype=dtype)
    if configs is None:
        # The interpreter runs one config (its "timings" are the CPU's, and each call is slow).
        configs = (fp8_gemm.default_config(m),) if _interpreted(device) else fp8_gemm.configs_for(m)
    if w8a8_configs is None:
        w8a8_configs = fp8_gemm.w8a8_configs_for(m) if TRY_W8A8 else ()
        w8a8_configs = w8a8_configs[:1] if _interpreted(device) else w8a8_configs
    first_w, first_s = weights[0]
    w_deq = first_w.to(torch.float32) * first_s[:, None]

    def candidate_us(product: Callable[..., torch.Tensor],
                     operand: Callable[[], torch.Tensor | QuantizedActivation], config: object,
                     reference: torch.Tensor, label: str) -> float:
        """us per call over every weight, `operand()` (x, or its quant) included in each call; inf
        if the product disagrees with the reference on the first weight or cannot run."""
        if not _agrees(lambda: product(operand(), first_w, first_s, config), reference, label):
            return float("inf")

        def call() -> None:
            for w, s in weights:
                product(operand(), w, s, config)
        return _timed_or_inf(call, device, label) / len(weights)

    bf16_product = x.to(torch.float32) @ w_deq.T  # what w8a16 computes
    timed = {config: candidate_us(fp8_gemm.w8a16, lambda: x, config, bf16_product, config.label())
             for config in configs}

    def scaled() -> None:
        for w, s in weights:
            fp8_gemm.scaled_mm(triton_quant.per_token_quant(x), w, s)
    scaled_us = _timed_or_inf(scaled, device, "scaled_mm") / len(weights)
    timed_w8a8 = {}
    if w8a8_configs:
        e4m3_product = triton_quant.per_token_quant(x).dequantize().to(torch.float32) @ w_deq.T
        timed_w8a8 = {config: candidate_us(fp8_gemm.w8a8, lambda: triton_quant.per_token_quant(x), config,
                                           e4m3_product, f"w8a8 {config.label()}")
                      for config in w8a8_configs}
    best = min(timed, key=timed.__getitem__)
    best_w8a8 = min(timed_w8a8, key=timed_w8a8.__getitem__) if timed_w8a8 else None
    w8a8_us = timed_w8a8[best_w8a8] if best_w8a8 is not None else float("inf")
    candidates = {"w8a16": timed[best], "scaled_mm": scaled_us, "w8a8": w8a8_us}
    path = min(candidates, key=candidates.__getitem__)  # ties: the order above
    if candidates[path] == float("inf"):
        raise RuntimeError(f"no FP8 product runs for x [{m}, {k}] @ {tuple(weights[0][0].shape)}")
    return Choice(path, best, timed[best], scaled_us, best_w8a8, w8a8_us)


def _agrees(product: Callable[[], torch.Tensor], reference: torch.Tensor, label: str) -> bool:
    """Whether a Triton candidate computes the product (within AGREEMENT of the float32 product of
    its dequantized operands); one that raises is left to _timed_or_inf to rule out and log."""
    try:
        out = product().to(torch.float32)
    except Exception:  # noqa: BLE001 - the timing runs it again and logs why
        return True
    error = float((out - reference).norm() / reference.norm().clamp(min=1e-30))
    if not error <= AGREEMENT:  # NaN too
        log.warning("fp8 candidate disagrees with the dequantized product, not chosen", candidate=label,
                    relative_error=error)
        return False
    return True


def _timed_or_inf(fn: Callable[[], None], device: torch.device, label: str) -> float:
    """time_us(fn); inf for a candidate this GPU cannot run (a tile config past its shared memory
    or registers: Triton's OutOfResources), which is then never chosen."""
    try:
        return time_us(fn, device)
    except Exception as exc:  # noqa: BLE001 - any failure rules the candidate out, and is logged
        log.warning("fp8 candidate failed, not chosen", candidate=label,
                    error=f"{type(exc).__name__}: {exc}"[:300])
        return float("inf")


def _interpreted(device: torch.device) -> bool:
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _spanning_l2(weights: list[tuple[torch.Tensor, torch.Tensor]],
                 device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """weights, plus copies of the first until they span L2_COPIES L2 caches (so none stays hot)."""
    if device.type != "cuda":
        return weights
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    w, s = weights[0]
    total = sum(w.numel() * w.element_size() for w, _ in weights)
    copies = max(0, -(-(L2_COPIES * l2 - total) // (w.numel() * w.element_size())))
    return weights + [(w.clone(), s.clone()) for _ in range(copies)]


def time_us(fn: Callable[[], None], device: torch.device) -> float:
    """us per call of fn: the best of REPLAYS replays of a CUDA graph of one call (GPU time, as in
    a captured step); on CPU (the interpreter) wall time of one call after a warm-up."""
    fn()  # warm-up: compiles
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # the side-stream warm-up a capture needs
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    best = float("inf")
    for _ in range(REPLAYS):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, begin.elapsed_time(end) * 1e3)
    del graph
    return best


def forget() -> None:
    """Drop the measured table (tests; a new device setting)."""
    _choices.clear()
