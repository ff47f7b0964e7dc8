"""bench_host_loop.py's engine without a model: an executor that samples token 5 for every
sampled work and runs nothing, and a burst stepped to the end on it (what is left is the
engine thread's host work per step)."""

from __future__ import annotations

import time

from scheduler.engine import LLMEngine
from shared.step import SampledToken, StepBatch, StepResult
from testkit.workloads import Workload, greedy


class SamplingOnlyExecutor:
    """submit/collect of an executor that runs no model: token 5 for every sampled work."""

    def submit(self, batch: StepBatch) -> StepBatch:
        return batch

    def collect(self, batch: StepBatch) -> StepResult:
        return StepResult(batch.step_id, [SampledToken(w.req_id, 5, None, None) for w in batch.works
                                          if w.is_sampled])


def run_burst(engine: LLMEngine, workload: Workload) -> tuple[float, int]:
    """(seconds, steps) to run every request of the workload to its max_tokens."""
    start = time.perf_counter()
    for prompt, max_tokens in zip(workload.prompts, workload.max_tokens, strict=True):
        engine.add_request(prompt, greedy(max_tokens))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return time.perf_counter() - start, steps
