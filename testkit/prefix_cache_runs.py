"""bench_prefix_cache.py's runs: chats sharing one long system prompt (or, the baseline of
the cache's cost, the same lengths sharing nothing), each workload stepped to the end on an
in-process engine with every request added at once; TTFT from that moment, and the block
manager's prefix-cache queries and hits over the run."""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass

import torch

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from testkit.engine_runs import EngineRun, run_engine_workload, warm_up
from testkit.runs import log, percentile
from testkit.workloads import Workload
from workers.device import resolve_device

FIRST_ORDINARY_ID = 3  # ids below are special tokens in SmolLM2's and most vocabularies


def chat_workload(num_chats: int, vocab_size: int, *, shared: bool, system_lens: tuple[int, int],
                  user_lens: tuple[int, int], max_tokens: int, seed: int) -> Workload:
    lengths = random.Random(seed)  # its own generator: both workloads of a seed get the same lengths
    rng = random.Random(seed + 1)
    ids = lambda n: [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(n)]  # noqa: E731
    system_len = lengths.randint(*system_lens)
    system = ids(system_len)
    prompts = []
    for _ in range(num_chats):
        user_len = lengths.randint(*user_lens)
        prompts.append((system if shared else ids(system_len)) + ids(user_len))
    return Workload(prompts, [max_tokens] * num_chats)


@dataclass
class Result:
    run: EngineRun
    prefix_cache_queries: int
    prefix_cache_hits: int

    @property
    def ttfts(self) -> list[float]:
        return [times[0] - self.run.start for times in self.run.token_times.values()]

    @property
    def ttft_p50(self) -> float:
        return percentile(self.ttfts, 50)

    @property
    def ttft_p99(self) -> float:
        return percentile(self.ttfts, 99)

    @property
    def hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def measure(engine: LLMEngine, workload: Workload, device: torch.device, seconds_limit: float) -> Result:
    manager = engine.scheduler.block_manager
    queries, hits = manager.prefix_cache_queries, manager.prefix_cache_hits
    run = run_engine_workload(engine, workload, seconds_limit, device)
    if run.partial_limit_s is not None:
        raise RuntimeError(f"the run passed --seconds-limit {seconds_limit:.0f}: shrink it with --chats")
    return Result(run, manager.prefix_cache_queries - queries, manager.prefix_cache_hits - hits)


def run_engine(config: EngineConfig, workloads: dict[str, list[Workload]], device: torch.device,
               seconds_limit: float) -> dict[str, list[Result]]:
    """Every workload (each repeat) on one engine; the engine is closed after."""
    engine = LLMEngine(config, load_tokenizer_files=False)
    try:
        warm_up(engine, engine.model_config.vocab_size)
        results: dict[str, list[Result]] = {name: [] for name in workloads}
        for repeat in range(max(map(len, workloads.values()))):
            for name, runs in workloads.items():
                result = measure(engine, runs[repeat], device, seconds_limit)
                results[name].append(result)
                log(f"{'with' if config.enable_prefix_caching else 'without'} caching, {name} #{repeat + 1}: "
                    f"{result.run.seconds:.1f} s, {result.run.output_rate:.1f} output tok/s, "
                    f"TTFT p50 {result.ttft_p50:.2f} s, hit rate {result.hit_rate:.0%}")
        return results
    finally:
        engine.close()
        gc.collect()


def config_dtype(base: dict) -> str:
    return base["dtype"] or ("bfloat16" if resolve_device(base["device"]).type == "cuda" else "float32")
