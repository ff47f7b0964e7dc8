"""Runs a StepBatch on every rank of a worker group and returns rank 0's StepResult.

- `InProcessExecutor`: one rank in the caller's process (TP=1, no Ray).
- `RayWorkerGroup` (workers/ray_group.py): PP x TP ranks as Ray actors on placement groups;
  used for TP or PP > 1, for replicas, or when `EngineConfig.use_ray` is set.

`submit` starts a step and `collect` waits for its result; a pipelined group (PP > 1) takes
`pipeline_depth` steps in flight at once, so that every stage has work. Under async scheduling
the engine submits step n+1 before it collects step n (one stage): in-process, `submit` queues
the step's kernels (on CUDA nothing waits) and `collect` waits for that step's sampled ids. A
step with grammar rows whose inputs are pending samples late: `submit` queues its forward, and
`sample`, once step n is collected and its tokens accepted by the matchers, its mask and sampling.
"""

from __future__ import annotations

from typing import Protocol

from shared.config import EngineConfig
from shared.errors import ModelLoadError
from shared.step import StepBatch, StepResult
from workers.model_runner import LaunchedStep
from workers.parallel import SINGLE_DEVICE
from workers.pooling_runner import make_runner


class Executor(Protocol):
    num_kv_blocks: int
    num_host_kv_blocks: int  # the host KV tier's blocks (0: none)
    kv_block_bytes: int  # one KV block over every rank
    max_model_len: int
    block_size: int

    # Steps that may be in flight at once (submitted, not yet collected): 1 but for pipelines.
    pipeline_depth: int
    # Whether a step may sample late (StepBatch.samples_late): its forward at `submit`, its
    # sampling at `sample`. Only where the sampling rank is this process.
    samples_late: bool

    def submit(self, batch: StepBatch) -> object:
        """Start a step; returns what `collect` takes."""

    def sample(self, handle: object) -> None:
        """Sample a submitted step that samples late, before the next step is submitted (its
        mask filled now: the engine calls this once the previous step's tokens are accepted)."""

    def collect(self, handle: object) -> StepResult:
        """The result of a submitted step, in submission order. Raises WorkerError when a rank
        failed (in either call); the KV cache is then lost."""

    def restart(self) -> None:
        """Rebuild the group after a WorkerError (fresh, empty KV cache)."""

    def rank_weight_bytes(self) -> list[int]: ...

    def shutdown(self) -> None:
        """Stop every rank and give back its device memory (ModelRunner.close). Idempotent."""


class InProcessExecutor:
    pipeline_depth = 1
    samples_late = True

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._start()

    def _start(self) -> None:
        self.runner = make_runner(self.config, SINGLE_DEVICE)  # generating or pooling (--runner)
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.num_host_kv_blocks = self.runner.num_host_kv_blocks
        self.kv_block_bytes = self.runner.kv_block_bytes
        self.max_model_len = self.runner.max_model_len
        self.block_size = self.runner.block_size

    def submit(self, batch: StepBatch) -> LaunchedStep:
        return self.runner.launch(batch)  # on a CPU it runs now; on CUDA its kernels are queued

    def sample(self, handle: LaunchedStep) -> None:
        self.runner.sample(handle)

    def collect(self, handle: LaunchedStep) -> StepResult:
        return self.runner.finish(handle)

    def restart(self) -> None:
        # The old runner goes first: on CUDA the new one sizes its KV cache from free memory.
        self.shutdown()
        self._start()

    def rank_weight_bytes(self) -> list[int]:
        return [self.runner.weight_bytes]

    def shutdown(self) -> None:
        """Give the runner's device memory back (graphs, KV cache, weights). Idempotent."""
        if self.runner is not None:
            self.runner.close()
        self.runner = None


def make_executor(config: EngineConfig) -> Executor:
    if config.tp < 1:
        raise ModelLoadError(f"tensor-parallel size must be >= 1, got {config.tp}")
    if config.pp < 1:
        raise ModelLoadError(f"pipeline-parallel size must be >= 1, got {config.pp}")
    if config.tp == 1 and config.pp == 1 and not config.use_ray:
        return InProcessExecutor(config)
    from workers.ray_group import RayWorkerGroup  # Ray is imported only when a group is used

    return RayWorkerGroup(config)
