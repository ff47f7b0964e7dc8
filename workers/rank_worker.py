"""One rank of a worker group: joins the torch.distributed group, loads its shard, runs steps.

The class is plain Python; `workers/ray_group.py` wraps it as a Ray actor. Every rank runs
`execute` on the same StepBatch; only rank 0 samples and returns a StepResult.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shared.config import EngineConfig, env_default
from shared.logging import configure_logging
from shared.step import StepBatch, StepResult
from workers.device import resolve_device
from workers.model_runner import ModelRunner
from workers.parallel import TensorParallel

# A collective that waits longer than this means a peer rank died: fail instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


@dataclass
class RankInfo:
    rank: int
    pid: int
    hostname: str
    weight_bytes: int
    num_kv_blocks: int
    max_model_len: int
    block_size: int


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class RankWorker:
    def __init__(self, config: EngineConfig, rank: int) -> None:
        configure_logging(env_default("log_level", "WARNING"))
        self.config = config
        self.rank = rank
        self.runner: ModelRunner | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This rank's node address and a free port on it (asked of rank 0)."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def hostname(self) -> str:
        return socket.gethostname()

    def load(self, master_addr: str, master_port: int) -> RankInfo:
        tp = TensorParallel(rank=self.rank, size=self.config.tp)
        if tp.size > 1:
            device = resolve_device(self.config.device)
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                world_size=tp.size, timeout=COLLECTIVE_TIMEOUT,
            )
        self.runner = ModelRunner(self.config, tp)
        return RankInfo(self.rank, os.getpid(), socket.gethostname(), self.runner.weight_bytes,
                        self.runner.num_kv_blocks, self.runner.max_model_len, self.runner.block_size)

    def execute(self, batch: StepBatch) -> StepResult | None:
        return self.runner.execute(batch)

    def receive(self, batch: StepBatch) -> None:
        """Take a batch and do nothing: measures the transport alone (scripts/bench_dispatch.py)."""

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.runner = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
