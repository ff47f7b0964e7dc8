"""bench_dispatch.py's measurements: an almost-empty decode step's dispatch timed in-process,
through a Ray worker group (plain actor calls, a Ray Compiled Graph) and through the compiled
graph's transport alone; SmolLM2's greedy throughput through TP=1 and TP=2 groups."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import ray
from ray.dag import InputNode, MultiOutputNode

from shared.config import EngineConfig
from shared.sampling import SamplingParams
from shared.step import SequenceWork, StepBatch
from testkit.workloads import greedy, uniform_workload
from workers.executor import InProcessExecutor
from workers.rank_worker import RankWorker
from workers.ray_group import RayWorkerGroup

GREEDY = SamplingParams(temperature=0.0)


def _decode_batch(step: int) -> StepBatch:
    return StepBatch(step, [SequenceWork("r", [5], 3, [0], True, GREEDY)])


def _one_step(executor):
    """A step start to end, as the engine runs one (submit, then collect)."""
    return lambda batch: executor.collect(executor.submit(batch))


def _time_steps(run_step, num_steps: int) -> float:
    """Median seconds of one step."""
    for i in range(20):  # warm-up
        run_step(_decode_batch(i))
    times = []
    for i in range(num_steps):
        start = time.perf_counter()
        run_step(_decode_batch(i))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_dispatch(folder: Path, num_steps: int) -> list[tuple[str, float]]:
    config = EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=4, block_size=16,
                          num_threads=1)
    rows = [("in-process runner (baseline)", _time_steps(_one_step(InProcessExecutor(config)), num_steps))]
    for tp in (1, 2):
        group = RayWorkerGroup(EngineConfig(**{**config.__dict__, "tp": tp, "use_ray": True}))
        actors = group.actors

        def plain_calls(batch: StepBatch, actors=actors) -> None:
            refs = [actor.execute.remote(batch) for actor in actors]
            ray.get(refs)

        rows.append((f"Ray TP={tp}, plain actor calls", _time_steps(plain_calls, num_steps)))
        rows.append((f"Ray TP={tp}, compiled graph", _time_steps(_one_step(group), num_steps)))
        group.shutdown()
        # The transport alone: ranks (no model loaded) take the batch and return at once.
        bare = [ray.remote(RankWorker).options(num_cpus=1).remote(config, rank) for rank in range(tp)]
        with InputNode() as inp:
            noop = MultiOutputNode([actor.receive.bind(inp) for actor in bare]).experimental_compile()
        rows.append((f"Ray TP={tp}, compiled graph, no-op ranks (transport only)",
                     _time_steps(lambda batch, noop=noop: ray.get(noop.execute(batch)), num_steps)))
        noop.teardown(kill_actors=True)
    return rows


def measure_throughput(tp: int, model: str) -> float:
    from scheduler.engine import LLMEngine

    workload = uniform_workload(16, 49152, prompt_lens=(64, 64), output_lens=(64, 64))
    config = EngineConfig(model=model, dtype="float32", tp=tp, use_ray=True, num_kv_blocks=256)
    with LLMEngine(config, load_tokenizer_files=False) as engine:
        engine.generate(workload.prompts[:2], greedy(4))
        start = time.perf_counter()
        results = engine.generate(workload.prompts, [greedy(m) for m in workload.max_tokens])
        elapsed = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / elapsed
