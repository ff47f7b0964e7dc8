"""The controller on a thread of its own, with its launcher: what `tokenfleet up` and
`tokenfleet autoscale` start."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from protocol.keys import Keys, keys_for
from shared.logging import get_logger
from shared.redis_client import connect
from tokenfleet.autoscale.controller import AutoscaleController
from tokenfleet.autoscale.launcher import PlacementRequest, ProcessReplicaLauncher, RayPlacement
from tokenfleet.autoscale.policy import ScalingPolicy


@dataclass
class AutoscaleOptions:
    policy: ScalingPolicy
    interval_s: float = 1.0  # how often the controller looks
    placement_timeout_s: float = 60.0  # a replica's group not placed by then is reported unplaced
    drain_timeout_s: float = 300.0  # a draining replica's leftovers are taken over after this


def placement_request(num_ranks: int, *, on_gpu: bool, num_cpus_per_rank: float = 1.0,
                      strategy: str = "STRICT_PACK", timeout_s: float = 60.0) -> PlacementRequest:
    """The bundles a replica's worker group asks for (as workers/ray_group.py builds them): one
    per rank, PP x TP of them (rank r is bundle r, stage r // TP)."""
    bundle = {"GPU": 1.0, "CPU": 1.0} if on_gpu else {"CPU": num_cpus_per_rank}
    return PlacementRequest([bundle] * num_ranks, strategy, timeout_s)


class AutoscaleRunner:
    def __init__(self, redis_url: str, model_name: str, options: AutoscaleOptions,
                 argv_for: Callable[[str, str | None], list[str]], log_dir: Path, *, env: dict[str, str],
                 ray_address: str | None = None, placement: PlacementRequest | None = None,
                 keys: Keys | None = None) -> None:
        """`placement` None: replicas run their model in their own process (no Ray group)."""
        ray_placement = None
        if placement is not None:
            ray_placement = RayPlacement(ray_address, placement, env)
        launcher = ProcessReplicaLauncher(argv_for, log_dir, env, ray_placement)
        client = connect(redis_url, socket_timeout=10, socket_connect_timeout=5)
        self.controller = AutoscaleController(client, keys or keys_for(redis_url), model_name, options.policy,
                                              launcher,
                                              interval_s=options.interval_s,
                                              drain_timeout_s=options.drain_timeout_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenfleet-autoscale", daemon=True)
        self.error: BaseException | None = None
        self.log = get_logger("tokenfleet.autoscale")

    def _run(self) -> None:
        try:
            self.controller.run(self._stop)
        except BaseException as exc:  # noqa: BLE001 - reported to whoever waits on us
            self.error = exc
            self.log.exception("autoscaler_failed")

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self.controller.close()
        if self.controller.launcher.placement is not None:
            import ray

            ray.shutdown()  # before `up` stops the Ray head this process is connected to
