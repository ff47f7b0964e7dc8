"""Data parallelism in-process: N engines side by side, each with its own worker group,
scheduler and KV cache. Requests are shared out by load before the engines start, then
each engine runs its own step loop in a thread (a step waits on Ray, not on the GIL).

The Redis service does the same thing differently: each replica is a scheduler process
pulling from the shared stream, so load balances itself.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

from scheduler.engine import GenerationResult, LLMEngine
from shared.config import EngineConfig
from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams


class ReplicatedEngine:
    def __init__(self, config: EngineConfig, num_replicas: int) -> None:
        if num_replicas < 1:
            raise InvalidRequestError(f"replicas must be >= 1, got {num_replicas}", param="replicas")
        # Each replica is its own Ray group, so replicas compute in parallel processes.
        config = dataclasses.replace(config, use_ray=True)
        self.engines: list[LLMEngine] = []
        try:
            for _ in range(num_replicas):
                self.engines.append(LLMEngine(config))
        except BaseException:
            self.close()
            raise
        self.num_requests_per_replica = [0] * num_replicas

    def generate(
        self, prompts: list[str | list[int]], sampling: SamplingParams | list[SamplingParams],
        *, chat: bool = False, lora_names: list[str | None] | None = None,
    ) -> list[GenerationResult]:
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        loras = lora_names if lora_names is not None else [None] * len(prompts)
        encoded = [p if isinstance(p, list) else self.engines[0].encode(p, chat=chat) for p in prompts]
        # Longest-first onto the least-loaded replica (load = prompt + max output tokens).
        shares: list[list[int]] = [[] for _ in self.engines]
        loads = [0] * len(self.engines)
        cost = [len(ids) + sp.max_tokens for ids, sp in zip(encoded, params, strict=True)]
        for index in sorted(range(len(encoded)), key=lambda i: -cost[i]):
            target = loads.index(min(loads))
            shares[target].append(index)
            loads[target] += cost[index]
        with ThreadPoolExecutor(len(self.engines)) as pool:
            futures = [
                pool.submit(engine.generate, [encoded[i] for i in share], [params[i] for i in share],
                            lora_names=[loras[i] for i in share])
                for engine, share in zip(self.engines, shares, strict=True)
            ]
            outputs = [future.result() for future in futures]
        results: list[GenerationResult | None] = [None] * len(encoded)
        for replica, (share, replica_results) in enumerate(zip(shares, outputs, strict=True)):
            self.num_requests_per_replica[replica] += len(share)
            for index, result in zip(share, replica_results, strict=True):
                results[index] = result
        return results

    def close(self) -> None:
        for engine in self.engines:
            engine.close()

    def __enter__(self) -> ReplicatedEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
