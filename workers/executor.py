"""Runs a StepBatch on every rank of a worker group and returns the driver's StepResult.

- `InProcessExecutor`: TP=1, the model lives in the caller's process.
- `MultiprocessExecutor`: TP=N as plain torch.distributed processes (gloo on CPU, NCCL on
  CUDA). Rank 0 lives in the caller's process and samples; ranks 1..N-1 are child
  processes that wait in a loop for the next batch. A dead rank becomes a WorkerError,
  never a hang: the driver checks that every child is alive before each step, and
  collectives carry a timeout.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import socket
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Protocol

import torch
import torch.distributed as dist

from shared.config import EngineConfig, env_default
from shared.errors import ModelLoadError, TokenfleetError, WorkerError
from shared.logging import configure_logging, get_logger
from shared.step import StepBatch, StepResult
from workers.device import resolve_device
from workers.model_runner import ModelRunner
from workers.parallel import SINGLE_DEVICE, TensorParallel

STARTUP_TIMEOUT_S = 600.0
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


class Executor(Protocol):
    num_kv_blocks: int
    max_model_len: int
    block_size: int

    def execute(self, batch: StepBatch) -> StepResult: ...

    def rank_weight_bytes(self) -> list[int]: ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config, SINGLE_DEVICE)
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.max_model_len = self.runner.max_model_len
        self.block_size = self.runner.block_size

    def execute(self, batch: StepBatch) -> StepResult:
        return self.runner.execute(batch)

    def rank_weight_bytes(self) -> list[int]:
        return [self.runner.weight_bytes]

    def shutdown(self) -> None:
        self.runner = None


def make_executor(config: EngineConfig) -> Executor:
    if config.tp < 1:
        raise ModelLoadError(f"tensor-parallel size must be >= 1, got {config.tp}")
    return InProcessExecutor(config) if config.tp == 1 else MultiprocessExecutor(config)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_group(config: EngineConfig, rank: int, init_method: str) -> TensorParallel:
    device = resolve_device(config.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=config.tp,
                            timeout=COLLECTIVE_TIMEOUT)
    return TensorParallel(rank=rank, size=config.tp)


def _worker_main(config: EngineConfig, rank: int, init_method: str, conn: Connection) -> None:
    """Body of ranks 1..N-1: load the shard, report, then run every batch the driver sends."""
    configure_logging(env_default("log_level", "WARNING"))
    try:
        runner = ModelRunner(config, _init_group(config, rank, init_method))
        conn.send(("ready", runner.weight_bytes))
        while True:
            message, batch = conn.recv()
            if message == "stop":
                break
            runner.execute(batch)
    except EOFError:  # the driver went away
        pass
    except TokenfleetError as exc:
        conn.send(("error", exc.message))
    except Exception:  # noqa: BLE001 - reported to the driver, which raises it
        conn.send(("error", traceback.format_exc(limit=5)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class MultiprocessExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.log = get_logger("tokenfleet.executor")
        if config.num_threads is None and resolve_device(config.device).type == "cpu":
            # Ranks share the machine's cores; oversubscribing them slows every rank.
            config = dataclasses.replace(config, num_threads=max(1, (os.cpu_count() or 1) // config.tp))
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[mp.Process] = []
        for rank in range(1, config.tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(config, rank, init_method, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        try:
            self.runner = ModelRunner(config, _init_group(config, 0, init_method))
            self.worker_weight_bytes = [self._wait_ready(i) for i in range(len(self.conns))]
        except BaseException:
            self.shutdown()
            raise
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.max_model_len = self.runner.max_model_len
        self.block_size = self.runner.block_size

    def _wait_ready(self, index: int) -> int:
        conn = self.conns[index]
        if not conn.poll(STARTUP_TIMEOUT_S):
            raise WorkerError(f"rank {index + 1} did not start within {STARTUP_TIMEOUT_S:.0f} s")
        kind, payload = conn.recv()
        if kind == "error":
            raise ModelLoadError(f"rank {index + 1} failed to start: {payload}")
        return payload

    def _check_workers(self) -> None:
        for index, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True)):
            if conn.poll():
                _, payload = conn.recv()
                raise WorkerError(f"rank {index + 1} failed: {payload}")
            if not proc.is_alive():
                raise WorkerError(f"rank {index + 1} died (exit code {proc.exitcode})")

    def execute(self, batch: StepBatch) -> StepResult:
        self._check_workers()
        try:
            for conn in self.conns:
                conn.send(("step", batch))
            return self.runner.execute(batch)
        except (RuntimeError, BrokenPipeError, ConnectionError) as exc:
            # A collective that timed out or a rank that vanished mid-step.
            raise WorkerError(f"step {batch.step_id} failed on the worker group: {exc}") from exc

    def rank_weight_bytes(self) -> list[int]:
        return [self.runner.weight_bytes, *self.worker_weight_bytes]

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.procs.clear()
        self.conns.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
