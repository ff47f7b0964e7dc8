"""Engine runs in this process: a Ray of the run's own, a warm-up, and a workload stepped with
every request added at once (steps, CUDA-graph replays and time in the workers' execute counted)."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from testkit.roofline import sync
from testkit.workloads import Workload, greedy, warmup_prompts

if TYPE_CHECKING:
    import torch

    from scheduler.engine import LLMEngine

def start_local_ray(env_vars: dict[str, str]) -> None:
    """A Ray for this run alone (never a cluster some `ray start` left recorded), its workers
    started with `env_vars` (NCCL settings must reach every rank before NCCL starts)."""
    import ray

    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 4), include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": env_vars})


def warm_up(engine: LLMEngine, vocab_size: int) -> None:
    """First-call costs (kernel compiles, cuBLAS plans, prefill attention) are not throughput.
    (The engine tunes the garbage collector itself, as the fleet's scheduler runs it.)"""
    engine.generate(warmup_prompts(vocab_size, engine.max_model_len), greedy(8))


@dataclass
class EngineRun:
    seconds: float
    num_requests: int
    num_output_tokens: int
    num_total_tokens: int  # output tokens + prompts of the requests that started
    num_steps: int
    num_graph_steps: int | None  # decode steps replayed from a CUDA graph (None: no graphs)
    execute_s: float  # in the workers' execute
    token_times: dict[str, list[float]]  # req_id -> perf_counter when each step giving it tokens returned
    start: float  # perf_counter when the first request was added
    partial_limit_s: float | None = None  # stopped at this time limit

    @property
    def output_rate(self) -> float:
        return self.num_output_tokens / self.seconds

    @property
    def total_rate(self) -> float:
        return self.num_total_tokens / self.seconds

    @property
    def notes(self) -> str:
        replays = f" ({self.num_graph_steps} CUDA-graph decodes)" if self.num_graph_steps is not None else ""
        notes = (f"{self.num_requests} requests; {self.num_steps} steps{replays}; "
                 f"{self.execute_s / self.seconds:.0%} of the time in the workers' execute")
        if self.partial_limit_s is not None:
            notes += (f"; PARTIAL: stopped at the {self.partial_limit_s:.0f} s limit, "
                      f"{len(self.token_times)} requests started")
        return notes


def run_engine_workload(engine: LLMEngine, workload: Workload, seconds_limit: float,
                        device: torch.device) -> EngineRun:
    """Every request added at once, then stepped until done or until the time limit (then the rest
    is aborted and the run is partial). Counts steps, CUDA-graph replays and time in execute."""
    runner = getattr(engine.executor, "runner", None)
    counts = {"steps": 0, "graph_steps": 0, "execute_s": 0.0}
    executor = engine.executor
    submit, collect = executor.submit, executor.collect

    def timed_submit(batch):
        start = time.perf_counter()
        try:
            return submit(batch)
        finally:
            counts["execute_s"] += time.perf_counter() - start

    def timed_collect(handle):
        start = time.perf_counter()
        try:
            return collect(handle)
        finally:
            counts["steps"] += 1
            counts["execute_s"] += time.perf_counter() - start

    executor.submit, executor.collect = timed_submit, timed_collect
    graphs = getattr(runner, "decode_graphs", None)
    if graphs is not None:
        graph_run = graphs.run

        def counted_run(*args, **kwargs):  # (whatever DecodeGraphs.run takes)
            counts["graph_steps"] += 1
            return graph_run(*args, **kwargs)

        graphs.run = counted_run
    prompt_len: dict[str, int] = {}
    token_times: dict[str, list[float]] = {}
    sync(device)
    start = time.perf_counter()
    for prompt, max_tokens in zip(workload.prompts, workload.max_tokens, strict=True):
        prompt_len[engine.add_request(prompt, greedy(max_tokens))] = len(prompt)
    num_output, partial = 0, False
    while engine.has_unfinished_requests():
        now, made = record_step(engine, token_times)
        num_output += made
        if now - start > seconds_limit:
            partial = True
            break
    elapsed = time.perf_counter() - start
    del executor.submit, executor.collect  # the class's own again
    if graphs is not None:
        graphs.run = graph_run
    if partial:
        for req_id in prompt_len:
            engine.abort(req_id)
        while engine.has_unfinished_requests():
            engine.step()
    elif num_output != workload.num_output_tokens:
        raise RuntimeError(f"the engine made {num_output} tokens, not {workload.num_output_tokens}")
    num_total = num_output + sum(prompt_len[r] for r in token_times)
    return EngineRun(elapsed, len(workload.prompts), num_output, num_total, counts["steps"],
                     counts["graph_steps"] if graphs is not None else None, counts["execute_s"], token_times,
                     start, seconds_limit if partial else None)


def engine_decode_latency(engine: LLMEngine, vocab_size: int, device: torch.device,
                          num_prompt: int = 128, num_output: int = 128) -> float:
    """Seconds per output token of one request alone, its prefill step left out (best of 2)."""
    rng = random.Random(1)
    best = float("inf")
    for _ in range(2):
        prompt = [rng.randrange(vocab_size) for _ in range(num_prompt)]
        engine.add_request(prompt, greedy(num_output))
        engine.step()  # the prefill and the first token
        sync(device)
        start, count = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            count += sum(len(out.new_token_ids) for out in engine.step())
        best = min(best, (time.perf_counter() - start) / max(count, 1))
    return best


def record_step(engine, token_times: dict[str, list[float]]) -> tuple[float, int]:
    """One engine step; when it returned, appended to each request that got tokens in it.
    Returns (that time, the tokens the step made)."""
    outputs = engine.step()
    now = time.perf_counter()
    made = 0
    for out in outputs:
        if out.new_token_ids:
            made += len(out.new_token_ids)
            token_times.setdefault(out.req_id, []).append(now)
    return now, made
