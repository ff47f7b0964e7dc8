"""bench_attention_gpu.py's measurements: the paged decode attention kernel the engine runs
(workers/layers/triton_attention.py, each decode kernel it can take) timed on one layer of
Llama-3-8B-shaped steps, against the bytes it must move and the card's copy bandwidth measured
in the same run; and a mixed step's decode and prefill rows as two launches (the engine's
default) against one.

A decode step's bytes: every row's K and V over its whole context, the block-table entries of
its pages, its sequence lengths and query offsets, q read and the output written. At Llama-3-8B's
heads the K/V term is 4 MiB a row at 1k tokens, the rest ~17 KB a row (0.4%), less at longer
contexts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from testkit.roofline import copy_bandwidth
from workers.layers import triton_attention as ta
from workers.layers import triton_decode_attention as split_kernel


@dataclass(frozen=True)
class HeadShape:
    num_heads: int = 32  # Llama-3-8B
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16


def paged_step(query_lens: list[int], cached: list[int], *, shape: HeadShape = HeadShape(),
               dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None,
               device: str | torch.device = "cuda", seed: int = 0) -> dict:
    """One layer's paged-attention inputs: sequence s has cached[s] tokens before the step and
    query_lens[s] in it, its pages scattered at random over a cache of exactly the pages needed;
    q in dtype, the K/V cache in kv_dtype (None: dtype; float8_e4m3fn for an FP8 cache), drawn
    on the device in dtype (long contexts: GBs of cache, no float32 copy)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(cached, query_lens, strict=True)]
    pages_per_seq = [-(-n // shape.page_size) for n in seq_lens]
    order = torch.randperm(sum(pages_per_seq), generator=gen)
    tables = torch.zeros((len(seq_lens), max(pages_per_seq)), dtype=torch.long)
    used = 0
    for s, n in enumerate(pages_per_seq):
        tables[s, :n] = order[used:used + n]
        used += n
    cache_shape = (len(order), shape.page_size, shape.num_kv_heads, shape.head_dim)
    device_gen = torch.Generator(device=device).manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    draw_dtype = dtype if kv_dtype.is_floating_point and kv_dtype.itemsize >= 2 else torch.bfloat16

    def cache() -> torch.Tensor:
        return torch.randn(cache_shape, generator=device_gen, device=device, dtype=draw_dtype).to(kv_dtype)

    q = torch.randn(sum(query_lens), shape.num_heads, shape.head_dim, generator=gen)
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    return dict(q=q.to(device, dtype), k_cache=cache(), v_cache=cache(), block_tables=tables.to(device),
                seq_lens=torch.tensor(seq_lens, device=device),
                query_start_loc=torch.tensor(starts, device=device))


def step_bytes(step: dict) -> int:
    """Bytes a step's attention must move at least: K and V of every sequence's context, its
    pages' table entries, lengths and offsets, q read and the output written."""
    k_cache = step["k_cache"]
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    seq_lens = step["seq_lens"].tolist()
    kv = sum(seq_lens) * num_kv_heads * head_dim * k_cache.element_size() * 2
    tables = sum(-(-n // page_size) for n in seq_lens) * step["block_tables"].element_size()
    meta = (step["seq_lens"].numel() + step["query_start_loc"].numel()) * step["seq_lens"].element_size()
    q = step["q"].numel() * step["q"].element_size()
    return kv + tables + meta + 2 * q


def attention_call(step: dict, *, num_decodes: int | None = None,
                   num_segments: int | None = None) -> Callable:
    """The engine's entry point on this step (num_decodes None: decode-only)."""
    max_query_len = int((step["query_start_loc"][1:] - step["query_start_loc"][:-1]).max())
    args = (step["q"], step["k_cache"], step["v_cache"], step["block_tables"], step["seq_lens"],
            step["query_start_loc"], max_query_len, step["q"].shape[-1] ** -0.5, num_decodes or 0)
    return lambda: ta.paged_attention(*args, num_segments=num_segments)


@contextlib.contextmanager
def settings(**values) -> Iterator[None]:
    """triton_attention's module settings (DECODE_KERNEL, SPLIT_MIXED, ...) for a block."""
    before = {name: getattr(ta, name) for name in values}
    for name, value in values.items():
        setattr(ta, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(ta, name, value)


def kernel_error(kernel: str) -> str | None:
    """What is wrong with a --kernels entry: "paged", "split", or "split:NAME=VALUE,..." setting
    triton_decode_attention's integer constants (BLOCK_N, NUM_WARPS, NUM_STAGES, ...); None: fine."""
    name, _, assignments = kernel.partition(":")
    if name not in ta.DECODE_KERNELS:
        return f"{name!r} is not one of {', '.join(ta.DECODE_KERNELS)}"
    for assignment in filter(None, assignments.split(",")):
        setting, _, value = assignment.partition("=")
        is_setting = setting.isupper() and isinstance(getattr(split_kernel, setting, None), int)
        if name != "split" or not is_setting:
            return f"{assignment!r}: only the split kernel's integer settings can be set (split:BLOCK_N=32)"
        if not value.isdigit():
            return f"{assignment!r}: the value must be a whole number"
    return None


@contextlib.contextmanager
def decode_kernel(kernel: str) -> Iterator[None]:
    """The engine's decode launches through `kernel` (see kernel_error) for a block."""
    name, _, assignments = kernel.partition(":")
    values = {s: int(v) for s, _, v in (a.partition("=") for a in filter(None, assignments.split(",")))}
    before = {setting: getattr(split_kernel, setting) for setting in values}
    for setting, value in values.items():
        setattr(split_kernel, setting, value)
    try:
        with settings(DECODE_KERNEL=name):
            yield
    finally:
        for setting, value in before.items():
            setattr(split_kernel, setting, value)


def seconds_of(call: Callable, device: torch.device) -> tuple[float, float]:
    """Median seconds of a call as a CUDA-graph replay (as the engine serves decode steps) and
    eagerly (launches and allocations included), by triton's do_bench; in the interpreter one
    timed call after a warm one, for both (not a measurement of any device)."""
    if device.type == "cuda":
        import triton

        from testkit.gpu_profile import replay_of

        def median(fn: Callable) -> float:
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3

        return median(replay_of(call)), median(call)
    call()
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    return seconds, seconds


@dataclass
class BenchRow:
    case: str
    kernel: str
    rows: int
    context: int | str
    num_bytes: int
    graph_s: float
    eager_s: float
    note: str = ""

    def line(self, copy_rate: float) -> str:
        rate = self.num_bytes / self.graph_s
        return (f"| {self.case} | {self.kernel} | {self.rows} | {self.context} | "
                f"{self.num_bytes / 1e6:,.1f} | {self.graph_s * 1e6:,.1f} | {self.eager_s * 1e6:,.1f} | "
                f"{rate / 1e9:,.0f} | {rate / copy_rate:.0%} |{' ' + self.note if self.note else ''}")


HEADER = ("| case | kernel | rows | context | MB moved | us (graph) | us (eager) | GB/s | of copy |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")


def measure_copy(device: torch.device, num_bytes: int) -> float:
    """The card's copy bandwidth (bytes read + written per second) of a device-to-device copy."""
    return copy_bandwidth(device, num_bytes, min_seconds=1.0 if device.type == "cuda" else 0.2)


def decode_rows(contexts: list[int], batches: list[int], kernels: list[str], device: torch.device,
                dtype: torch.dtype, kv_dtype: torch.dtype, max_cache_bytes: int,
                shape: HeadShape = HeadShape()) -> Iterator[BenchRow]:
    """Decode-only steps of `batch` rows, each at exactly `context` tokens, per decode kernel."""
    for context in contexts:
        for batch in batches:
            cache_bytes = batch * context * shape.num_kv_heads * shape.head_dim * kv_dtype.itemsize * 2
            if cache_bytes > max_cache_bytes:
                print(f"skipped: {batch} rows x {context} tokens need {cache_bytes / 2**30:.1f} GiB of K/V "
                      f"(over --max-cache-gib)", flush=True)
                continue
            step = paged_step([1] * batch, [context - 1] * batch, shape=shape, dtype=dtype, kv_dtype=kv_dtype,
                              device=device)
            first = None  # the first kernel's output: every other must agree with it
            for kernel in kernels:
                with decode_kernel(kernel):
                    call = attention_call(step)
                    out = call().float()
                    first = out if first is None else first
                    error = float((out - first).norm() / first.norm())
                    note = f"DIFFERS from {kernels[0]}: relative error {error:.1e}" if error > 1e-2 else ""
                    yield BenchRow("decode", kernel, batch, context, step_bytes(step),
                                   *seconds_of(call, device), note=note)
            del step, first, out
            if device.type == "cuda":
                torch.cuda.empty_cache()


def mixed_rows(num_decodes: int, context: int, prefill_lens: list[int], kernels: list[str],
               device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
               shape: HeadShape = HeadShape()) -> Iterator[BenchRow]:
    """A mixed step (decodes first, then prefill chunks with nothing cached): its decode launch and
    its prefill launch alone, both as the engine runs them (two launches), and as one launch."""
    query_lens = [1] * num_decodes + prefill_lens
    cached = [context - 1] * num_decodes + [0] * len(prefill_lens)
    step = paged_step(query_lens, cached, shape=shape, dtype=dtype, kv_dtype=kv_dtype, device=device)
    decodes = paged_step([1] * num_decodes, [context - 1] * num_decodes, shape=shape, dtype=dtype,
                         kv_dtype=kv_dtype, device=device)
    prefills = paged_step(prefill_lens, [0] * len(prefill_lens), shape=shape, dtype=dtype, kv_dtype=kv_dtype,
                          device=device, seed=1)
    chunks = f"{len(prefill_lens)} x {'/'.join(map(str, sorted(set(prefill_lens))))}"

    def row(case: str, kernel: str, part: dict, call: Callable) -> BenchRow:
        rows = part["q"].shape[0]
        return BenchRow(case, kernel, rows, context if case != "mixed: prefill launch" else chunks,
                        step_bytes(part), *seconds_of(call, device))

    both = attention_call(step, num_decodes=num_decodes)
    with settings(SPLIT_MIXED=True):
        yield row("mixed: prefill launch", "mixed", prefills, attention_call(prefills, num_decodes=0))
        for kernel in kernels:
            with decode_kernel(kernel):
                yield row("mixed: decode launch", kernel, decodes, attention_call(decodes))
                yield row("mixed: both, two launches", kernel, step, both)
    with settings(SPLIT_MIXED=False):
        yield row("mixed: both, one launch", "mixed", step, both)
