"""bench_pp.py's measurements of one layout (TP and PP sizes) through a Ray worker group in this
process: load, weights per rank, greedy tokens, throughput and batch-1 decode on one engine;
then the bytes each rank moves between GPUs per step, on a short eager run with every
collective and stage hand-off counted. The caller sets NCCL's environment before torch starts."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import torch

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from testkit.engine_runs import engine_decode_latency, run_engine_workload, warm_up
from testkit.runs import log
from testkit.workloads import Workload, greedy
from workers.model_runner import format_bytes


def rank_calls(engine: LLMEngine, method: str) -> list:
    import ray

    return ray.get([getattr(actor, method).remote() for actor in engine.executor.actors], timeout=120)


def measure(name: str, config: EngineConfig, args: argparse.Namespace, vocab_size: int,
            prompts: list[list[int]], workload: Workload, device: torch.device) -> dict:
    found: dict = {"name": name}
    start = time.perf_counter()
    engine = LLMEngine(config, load_tokenizer_files=False)
    try:
        found["load_s"] = time.perf_counter() - start
        found["weight_bytes"] = engine.executor.rank_weight_bytes()
        found["kv_blocks"] = engine.executor.num_kv_blocks
        found["graphs"] = [len(sizes) for sizes in rank_calls(engine, "decode_graph_sizes")]
        log(f"{name}: loaded in {found['load_s']:.0f} s, weights per rank "
            f"{[format_bytes(b) for b in found['weight_bytes']]}, {found['kv_blocks']} KV blocks, "
            f"graphs per rank {found['graphs']}")
        warm_up(engine, vocab_size)
        found["greedy"] = [r.token_ids for r in engine.generate(prompts, greedy(args.num_tokens))]
        run = run_engine_workload(engine, workload, 240.0, device)
        found["rate"], found["notes"] = run.output_rate, run.notes
        log(f"{name}: {run.output_rate:,.0f} output tok/s ({run.notes})")
        seconds = engine_decode_latency(engine, vocab_size, device, num_output=args.batch1_tokens)
        found["batch1_ms"] = 1e3 * seconds
        log(f"{name}: batch-1 {found['batch1_ms']:.2f} ms/token")
        found["peak_in_flight"] = engine.executor.peak_in_flight
    finally:
        engine.close()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return found


def traffic(name: str, config: EngineConfig, workload: Workload, device: torch.device) -> dict:
    """Bytes each rank moved between GPUs, per step, on a short eager run with every collective
    and stage hand-off counted."""
    engine = LLMEngine(dataclasses.replace(config, time_collectives=True, cuda_graphs=False),
                       load_tokenizer_files=False)
    try:
        rank_calls(engine, "collective_times")  # forget the load and warm-up
        steps_before = engine.num_steps
        run = run_engine_workload(engine, workload, 120.0, device)
        times = rank_calls(engine, "collective_times")
        num_steps = engine.num_steps - steps_before
    finally:
        engine.close()
    rank0 = times[0]
    return {"name": name, "steps": num_steps, "tokens": run.num_total_tokens,
            "collective_bytes": rank0.collective_bytes, "p2p_bytes": rank0.p2p_bytes,
            "share": (rank0.collective_ms + rank0.p2p_ms) / rank0.step_ms if rank0.step_ms else None}
