"""How a replica comes and goes: the `ReplicaLauncher` protocol the controller calls, and the
implementation `tokenfleet up` and `tokenfleet autoscale` use: one scheduler process per replica,
its worker group's Ray placement group reserved first when the replica runs on Ray.

Reserving the group here, not in the scheduler, is what makes "cannot be placed" a clear
answer: the launcher asks Ray for the bundles and waits `placement_timeout_s`. On a cluster
with Ray's autoscaler that request is what brings a node up. Unplaced in time, the request is
withdrawn and `PlacementTimeout` raised: the controller reports it and backs off. The group
is named after the replica; the scheduler finds it by name (--placement-group) and the
launcher removes it once the scheduler has exited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from shared.errors import TokenfleetError
from shared.logging import get_logger

STOP_TIMEOUT_S = 10.0


class PlacementTimeout(TokenfleetError):
    """Ray could not place a replica's worker group within the timeout."""


class ReplicaLauncher(Protocol):
    def launch(self, replica_id: str) -> None:
        """Start a replica whose scheduler id is `replica_id`; raises PlacementTimeout."""

    def reap(self) -> dict[str, int]:
        """replica_id -> exit code of each replica that ended since the last call (its resources
        released by now)."""

    def running(self) -> set[str]:
        """Replicas started and not yet reaped."""

    def stop(self, replica_id: str) -> None:
        """Stop one replica now (SIGTERM; its entries are taken over after the lease)."""

    def close(self) -> None:
        """Stop every replica."""


@dataclass(frozen=True)
class PlacementRequest:
    bundles: list[dict[str, float]]  # one per rank, as the worker group asks for them
    strategy: str = "STRICT_PACK"
    timeout_s: float = 60.0


class RayPlacement:
    """Named placement groups for replicas, reserved from this process's Ray connection."""

    def __init__(self, ray_address: str | None, request: PlacementRequest,
                 env: dict[str, str] | None = None) -> None:
        # The token of an authenticated cluster (tokenfleet up starts Ray with one) is read
        # from the environment by ray.init.
        for name, value in (env or {}).items():
            if name.startswith("RAY_AUTH_"):
                os.environ[name] = value
        from workers.ray_group import ensure_ray

        # ray.init installs a SIGTERM handler that aborts the process: keep the caller's
        # (`up` and `autoscale` stop their replicas on SIGTERM).
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        ensure_ray(ray_address)
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                if handler is not None:  # (None: not set from Python, nothing to restore)
                    signal.signal(sig, handler)
        self.request = request
        self.log = get_logger("tokenfleet.autoscale.placement")

    @staticmethod
    def group_name(replica_id: str) -> str:
        return f"tokenfleet-replica-{replica_id}"

    def reserve(self, replica_id: str) -> str:
        from ray.util.placement_group import placement_group, remove_placement_group

        name = self.group_name(replica_id)
        pg = placement_group(self.request.bundles, strategy=self.request.strategy, name=name,
                             lifetime="detached")
        if not pg.wait(timeout_seconds=self.request.timeout_s):
            remove_placement_group(pg)
            raise PlacementTimeout(
                f"Ray could not place replica {replica_id} ({len(self.request.bundles)} x "
                f"{self.request.bundles[0]}, {self.request.strategy}) within {self.request.timeout_s:g} s")
        return name

    def release(self, replica_id: str) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(ray.util.get_placement_group(self.group_name(replica_id)))
        except ValueError:
            pass  # never reserved, or removed already


class ProcessReplicaLauncher:
    """One `tokenfleet scheduler` process per replica, in its own process group (its Ray
    workers and log go with it), started the way `tokenfleet up` starts its schedulers."""

    def __init__(self, argv_for: Callable[[str, str | None], list[str]], log_dir: Path,
                 env: dict[str, str] | None = None, placement: RayPlacement | None = None) -> None:
        self.argv_for = argv_for  # (replica_id, placement group name or None) -> command line
        self.log_dir = log_dir
        self.env = env or dict(os.environ)
        self.placement = placement
        self.processes: dict[str, subprocess.Popen] = {}  # replica_id -> its scheduler process
        self.log = get_logger("tokenfleet.autoscale.launcher")

    def launch(self, replica_id: str) -> None:
        group = self.placement.reserve(replica_id) if self.placement is not None else None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"scheduler-{replica_id}.log"
        with open(log_path, "ab") as log_file:  # the child keeps its own descriptor
            process = subprocess.Popen(self.argv_for(replica_id, group), stdout=log_file,
                                       stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.processes[replica_id] = process
        self.log.info("replica_process_started", replica=replica_id, pid=process.pid, log=str(log_path),
                      placement_group=group)

    def reap(self) -> dict[str, int]:
        ended = {rid: p.returncode for rid, p in self.processes.items() if p.poll() is not None}
        for replica_id in ended:
            process = self.processes.pop(replica_id)
            _signal_group(process, signal.SIGKILL)  # whatever the scheduler left in its group
            if self.placement is not None:
                self.placement.release(replica_id)
        return ended

    def running(self) -> set[str]:
        return set(self.processes)

    def stop(self, replica_id: str) -> None:
        process = self.processes.get(replica_id)
        if process is None:
            return
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.log.warning("killing_replica", replica=replica_id)
        _signal_group(process, signal.SIGKILL)
        process.wait()
        self.reap()

    def close(self) -> None:
        for process in self.processes.values():  # all at once: each takes up to STOP_TIMEOUT_S
            _signal_group(process, signal.SIGTERM)
        for replica_id in list(self.processes):
            self.stop(replica_id)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
