"""One rank of a worker group: joins the torch.distributed group, loads its shard, runs steps.

Rank r of a group of PP x TP ranks is rank r % TP of pipeline stage r // TP: it loads that
stage's layers, TP-sharded. The whole group is one torch.distributed world (the pipeline's
sends and receives, and agreeing on sizes), and each stage also has a process group of its own
for its tensor-parallel collectives.

The class is plain Python; `workers/ray_group.py` wraps it as a Ray actor. Every rank runs
`execute` on the same StepBatch; only rank 0 samples and returns a StepResult.

Between steps a rank waits in Ray's compiled-graph channel read, which spins (it polls the
channel with sched_yield and has no blocking mode). When the group has been idle for a
while, the driver sends `Park` instead of a batch: the rank then blocks (no CPU) in a read
of its wake socket until the driver sends it a datagram: straight to the socket from the
same host (tens of microseconds), through the `wake()` actor call from another one.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shared.config import MULTICAST_OFF_ENV, EngineConfig, env_default
from shared.logging import configure_logging
from shared.net import free_port
from shared.step import StepBatch, StepResult
from workers.device import resolve_device
from workers.model_runner import ModelRunner
from workers.parallel import CollectiveTimes, CudaSpanTimer, TensorParallel
from workers.pipeline import PipelineStage
from workers.pooling_runner import PoolingRunner, make_runner

# A collective that waits longer than this means a peer rank died: fail instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


@dataclass(frozen=True)
class Park:
    """Sent in place of a StepBatch when the group is idle: block in `execute` until `wake()`."""


@dataclass
class RankInfo:
    rank: int
    stage: int  # its pipeline stage
    pid: int
    hostname: str
    weight_bytes: int
    num_kv_blocks: int
    max_model_len: int
    block_size: int
    wake_address: str | bytes  # this rank's wake socket: an AF_UNIX datagram address on its host
    node_id: str = ""  # its Ray node ("" outside Ray)
    num_host_kv_blocks: int = 0  # its host KV pool's blocks (workers/host_kv_pool.py); 0: none
    kv_block_bytes: int = 0  # one block of its shard, in its GPU cache and in its host pool


@dataclass
class RankMemory:
    rank: int
    device: str
    weight_bytes: int  # this rank's parameters
    kv_cache_bytes: int  # including the scratch block
    allocated_bytes: int  # torch.cuda.memory_allocated (0 on CPU)
    max_allocated_bytes: int  # torch.cuda.max_memory_allocated
    reserved_bytes: int  # torch.cuda.memory_reserved: what the caching allocator holds


class RankWorker:
    def __init__(self, config: EngineConfig, rank: int) -> None:
        for name, value in MULTICAST_OFF_ENV.items():
            os.environ.setdefault(name, value)
        configure_logging(env_default("log_level", "WARNING"))
        self.config = config
        self.rank = rank
        self.runner: ModelRunner | PoolingRunner | None = None
        # A parked execute reads one datagram from this socket; anyone on the host may send it.
        self._wake_socket = _bind_wake_socket()
        # This rank's handle on the group's TCPStore; on rank 0 it is the store's server,
        # which must outlive every other rank's use of it (see shutdown).
        self._store: dist.TCPStore | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This rank's node address and a free port on it (asked of rank 0)."""
        import ray

        return ray.util.get_node_ip_address(), free_port(host="")

    def load(self, master_addr: str, master_port: int) -> RankInfo:
        timer = CudaSpanTimer() if self.config.time_collectives else None
        tp_size, pp_size = self.config.tp, self.config.pp
        stage_index, tp_rank = divmod(self.rank, tp_size)
        world_size = tp_size * pp_size
        stage_group = None
        if world_size > 1:
            device = resolve_device(self.config.device)
            backend = "nccl" if device.type == "cuda" else "gloo"
            self._store = dist.TCPStore(master_addr, master_port, world_size, is_master=self.rank == 0,
                                        timeout=COLLECTIVE_TIMEOUT)
            dist.init_process_group(backend, store=self._store, rank=self.rank, world_size=world_size,
                                    timeout=COLLECTIVE_TIMEOUT)
            if pp_size > 1 and tp_size > 1:
                # Every rank creates every stage's group, in the same order (new_group is collective).
                groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)),
                                         timeout=COLLECTIVE_TIMEOUT) for s in range(pp_size)]
                stage_group = groups[stage_index]
        tp = TensorParallel(rank=tp_rank, size=tp_size, timer=timer, group=stage_group)
        stage = PipelineStage(stage_index, pp_size, tp_rank, tp_size, timer=timer)
        self.runner = make_runner(self.config, tp, stage)  # generating or pooling (--runner)
        return RankInfo(self.rank, stage_index, os.getpid(), socket.gethostname(), self.runner.weight_bytes,
                        self.runner.num_kv_blocks, self.runner.max_model_len, self.runner.block_size,
                        self._wake_socket.getsockname(), _ray_node_id(),
                        self.runner.num_host_kv_blocks, self.runner.kv_block_bytes)

    def execute(self, batch: StepBatch | Park) -> StepResult | None:
        if isinstance(batch, Park):
            self._wake_socket.recv(16)  # blocks: no CPU while the group is idle
            return None
        return self.runner.execute(batch)

    def wake(self) -> None:
        """End a `Park`: for a driver on another host (an actor call, run on the actor's
        default thread while `execute` blocks on the compiled graph's)."""
        self._wake_socket.sendto(b"w", self._wake_socket.getsockname())

    def memory(self) -> RankMemory:
        runner = self.runner
        device = runner.device if runner is not None else torch.device("cpu")
        on_cuda = device.type == "cuda"
        return RankMemory(
            rank=self.rank, device=str(device),
            weight_bytes=runner.weight_bytes if runner is not None else 0,
            kv_cache_bytes=runner.kv_cache_bytes if runner is not None else 0,
            allocated_bytes=torch.cuda.memory_allocated(device) if on_cuda else 0,
            max_allocated_bytes=torch.cuda.max_memory_allocated(device) if on_cuda else 0,
            reserved_bytes=torch.cuda.memory_reserved(device) if on_cuda else 0,
        )

    def decode_graph_sizes(self) -> list[int]:
        """Batch sizes with a captured CUDA graph (empty: every step runs eagerly)."""
        graphs = self.runner.decode_graphs if self.runner is not None else None
        return list(graphs.sizes) if graphs is not None else []

    def collective_times(self) -> CollectiveTimes:
        """Step and collective GPU time since the last call (EngineConfig.time_collectives)."""
        timer = self.runner.tp.timer if self.runner is not None else None
        return timer.read() if timer is not None else CollectiveTimes()

    def receive(self, batch: StepBatch) -> None:
        """Take a batch and do nothing: measures the transport alone (scripts/bench_dispatch.py)."""

    def shutdown(self) -> None:
        """Free the model and leave the process group. The group calls it on every rank at
        once (NCCL's communicator teardown may be collective) and kills the actors only
        after every rank has returned, so no rank's NCCL watchdog is left polling a
        TCPStore whose server (rank 0) is already gone ("Broken pipe")."""
        runner, self.runner = self.runner, None
        if runner is not None:
            runner.close()  # CUDA graphs, KV cache and weights back to the device
        if dist.is_initialized():
            dist.destroy_process_group()
        # self._store stays: rank 0's server lives until the process ends, after the others left.
        self.wake()  # a rank still parked returns, so the graph's loop can end


def _ray_node_id() -> str:
    """The Ray node this process runs on; "" when it is no Ray worker."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except ImportError:
        return ""


def _bind_wake_socket() -> socket.socket:
    """An AF_UNIX datagram socket under a random name: in Linux's abstract namespace (no
    file, gone with the process), elsewhere a file in the temporary folder."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"tokenfleet-wake-{os.getpid()}-{os.urandom(6).hex()}"
    if sys.platform == "linux":
        sock.bind("\0" + name)
    else:
        import tempfile

        sock.bind(os.path.join(tempfile.gettempdir(), name))
    return sock
