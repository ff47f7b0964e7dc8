"""profile_gpu.py's measurements: an engine's steps timed by kind (decode-only CUDA-graph
replays, mixed prefill + decode steps run eagerly), a few of each under torch.profiler, and the
Triton paged-attention kernel per tile shape / warps / pipeline depth on one layer of
Llama-3-8B-shaped steps (eager and as a CUDA-graph replay)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

from scheduler.engine import LLMEngine
from testkit.attention_bench import HeadShape, paged_step


@dataclass
class StepProfile:
    total_s: float
    # kind -> [steps, seconds in execute, tokens]; a step is "mixed" when any work has a
    # prefill chunk (then it runs eagerly), else "decode" (a CUDA-graph replay).
    stats: dict[str, list] = field(default_factory=lambda: {"decode": [0, 0.0, 0], "mixed": [0, 0.0, 0]})
    # (prefill tokens, decodes) of each mixed step
    mixed_sizes: list[tuple[int, int]] = field(default_factory=list)
    prof_tables: dict[str, list] = field(default_factory=dict)  # kind -> [(profile, tokens)]


def profile_steps(engine: LLMEngine) -> StepProfile:
    """Steps the engine's requests to the end, each execute synchronised and timed by kind; the
    21st to 23rd step of each kind under torch.profiler."""
    found = StepProfile(0.0)
    stats, mixed_sizes, prof_tables = found.stats, found.mixed_sizes, found.prof_tables
    profiled = {"decode": 0, "mixed": 0}
    execute = engine.executor.submit  # in-process: submit runs the step

    def timed_execute(batch):
        kind = "mixed" if any(len(w.token_ids) > 1 for w in batch.works) else "decode"
        num_tokens = sum(len(w.token_ids) for w in batch.works)
        if kind == "mixed":
            num_decodes = sum(len(w.token_ids) == 1 for w in batch.works)
            mixed_sizes.append((num_tokens - num_decodes, num_decodes))
        do_profile = profiled[kind] < 3 and stats[kind][0] >= 20
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if do_profile:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                result = execute(batch)
                torch.cuda.synchronize()
            profiled[kind] += 1
            prof_tables.setdefault(kind, []).append((prof, num_tokens))
        else:
            result = execute(batch)
        torch.cuda.synchronize()
        stats[kind][0] += 1
        stats[kind][1] += time.perf_counter() - t0
        stats[kind][2] += num_tokens
        return result

    engine.executor.submit = timed_execute
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    found.total_s = time.perf_counter() - start
    return found


def attention_step(query_lens: list[int], cached: list[int], *, num_heads: int = 32, num_kv_heads: int = 8,
                   head_dim: int = 128, page_size: int = 16, kv_dtype: torch.dtype = torch.bfloat16) -> dict:
    """One layer's paged-attention inputs on the GPU, Llama-3-8B heads by default, q in bf16 and
    the K/V cache in kv_dtype (testkit/attention_bench.py's paged_step)."""
    return paged_step(query_lens, cached, shape=HeadShape(num_heads, num_kv_heads, head_dim, page_size),
                      dtype=torch.bfloat16, kv_dtype=kv_dtype, device="cuda")


def replay_of(call):
    """call() captured in a CUDA graph (after one eager run that compiles it): its replay."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def kernel_rows(only: str | None = None, only_configs: str | None = None) -> Iterator[str]:
    """The attention kernel timed per config on decode and mixed steps shaped like the workload
    (only: the steps whose name holds this text; only_configs: the configs whose text holds this,
    and the default): a markdown row each, as each is timed."""
    import triton

    from workers.layers import triton_attention as ta

    rng = random.Random(0)
    decode_steps = {
        "decode b=256, ctx 16..1500": ([1] * 256, [rng.randint(16, 1500) for _ in range(256)]),
        "decode b=64, ctx 16..1500": ([1] * 64, [rng.randint(16, 1500) for _ in range(64)]),
        # bench_quant.py's long-context workload: 8k-token prompts, 512 outputs
        "decode b=64, ctx 8192..8704": ([1] * 64, [rng.randint(8192, 8704) for _ in range(64)]),
    }
    mixed_steps = {
        "mixed 100 dec + 30 prefills": ([1] * 100 + [rng.randint(16, 500) for _ in range(30)],
                                        [rng.randint(16, 1000) for _ in range(100)] + [0] * 30),
        "mixed 250 dec + 2 prefills": ([1] * 250 + [300, 180],
                                       [rng.randint(16, 1000) for _ in range(250)] + [0, 0]),
        "prefill 8 x 1000": ([1000] * 8, [0] * 8),
    }
    # module setting -> value; each config is applied over the defaults ("segments": the split-K
    # of decode launches, forced, instead of decode_segments' choice by occupancy)
    decode_configs = [{}, {"DECODE_BLOCK_N": 64}, {"NUM_STAGES": 3}, {"NUM_WARPS": 8}, {"segments": 2},
                      {"segments": 4}, {"DECODE_BLOCK_N": 64, "segments": 2}]
    # An FP8 cache: widened to float16 (the default) or to bf16, and the split that suits its
    # cheaper tiles.
    fp8_configs = [{}, {"FP8_WIDEN_FP16": False}, {"segments": 2}, {"segments": 4}, {"NUM_STAGES": 3},
                   {"NUM_STAGES": 3, "segments": 2}, {"DECODE_BLOCK_N": 64, "segments": 2},
                   {"NUM_WARPS": 8, "segments": 2}]
    mixed_configs = [{}, {"SPLIT_MIXED": False}, {"MIXED_BLOCK_N": 32}, {"MIXED_BLOCK_M": 128},
                     {"MIXED_BLOCK_M": 128, "MIXED_NUM_WARPS": 8},
                     {"MIXED_BLOCK_M": 128, "MIXED_BLOCK_N": 32}, {"NUM_STAGES": 3}]
    settings = ("DECODE_BLOCK_N", "MIXED_BLOCK_N", "MIXED_BLOCK_M", "NUM_WARPS", "MIXED_NUM_WARPS",
                "NUM_STAGES", "SPLIT_MIXED", "FP8_WIDEN_FP16")
    defaults = {name: getattr(ta, name) for name in settings}
    # Eager (launch and partial buffers included, as do_bench sees them: a split launch's second
    # kernel and allocations can leave the GPU idle) and as a CUDA-graph replay, as served.
    cases = [(name, case, torch.bfloat16, mixed_configs) for name, case in mixed_steps.items()]
    cases += [(name, case, kv, decode_configs if kv == torch.bfloat16 else fp8_configs)
              for name, case in decode_steps.items() for kv in (torch.bfloat16, torch.float8_e4m3fn)]
    cases = [case for case in cases if only is None or only in case[0]]
    try:
        for name, (query_lens, cached), kv_dtype, configs in cases:
            step = attention_step(query_lens, cached, kv_dtype=kv_dtype)
            kv_bytes = (sum(c + n for c, n in zip(cached, query_lens, strict=True)) * 8 * 128 * 2
                        * step["k_cache"].element_size())
            num_decodes = next((i for i, n in enumerate(query_lens) if n > 1), len(query_lens))
            args = (step["q"], step["k_cache"], step["v_cache"], step["block_tables"], step["seq_lens"],
                    step["query_start_loc"], max(query_lens), 128**-0.5, num_decodes)
            for config in configs:
                if config and only_configs is not None and only_configs not in str(config):
                    continue
                config = dict(config)
                segments = config.pop("segments", None)
                for setting, value in {**defaults, **config}.items():
                    setattr(ta, setting, value)
                row = f"| {name} | {str(kv_dtype).removeprefix('torch.')} | " \
                      f"{config or 'default'}{f' segments={segments}' if segments else ''} |"
                try:
                    def call(args=args, segments=segments):
                        return ta.paged_attention(*args, num_segments=segments)
                    ms = triton.testing.do_bench(call, warmup=50, rep=200, return_mode="median")
                    graph_ms = triton.testing.do_bench(replay_of(call), warmup=50, rep=200,
                                                       return_mode="median")
                    yield f"{row} {ms * 1e3:.1f} | {graph_ms * 1e3:.1f} | {kv_bytes / graph_ms / 1e6:,.0f} |"
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is a row too
                    yield f"{row} failed: {type(exc).__name__}: {str(exc)[:80]} | |"
    finally:
        for setting, value in defaults.items():
            setattr(ta, setting, value)
