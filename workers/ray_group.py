"""A worker group placed by Ray: one actor per rank on its own bundle; PP stages of TP ranks.

    placement group per pipeline stage (one bundle per rank: {"GPU": 1} on GPU hosts, N CPUs
    otherwise; --placement-strategy, STRICT_PACK by default, applies within a stage, so stages may sit on
    different nodes)
      └─ RankWorker actor per rank ── torch.distributed (NCCL on CUDA, gloo on CPU),
                                      rendezvous at rank 0's node on a free port

Steps are dispatched through a Ray Compiled Graph: the batch is written once into Ray's
shared-memory channels and every rank reads it (about 0.2 ms per step here, against
about 1.6 ms for plain actor calls; see scripts/bench_dispatch.py). Only rank 0 returns
sampled tokens (rank 0 of the last stage). A rank that dies, or a step that exceeds its
timeout, raises WorkerError; `restart()` tears the group down and builds a new one.

A pipeline keeps up to PP steps in flight (`submit` several, `collect` in order): every rank
reads each step from the graph's input channel in turn, so stage 0 starts step k+1 while
stage 1 still computes step k, and only the last stage's rank 0 returns anything.

Idle ranks park. A rank waiting for its next step spins in Ray's channel read (a
sched_yield loop with no blocking mode: a full core per rank). That is what back-to-back
steps want, but an idle fleet must not burn cores, so a thread of the group sends the ranks
`Park` once no step has come for PARK_AFTER_S: each rank then blocks reading a socket, and
the next step first wakes them with a datagram (a rank on another host: an actor call).

Stopping: every rank leaves its process group (all at once, NCCL's teardown may be
collective) before any actor is killed, so no rank is left talking to rank 0's TCPStore.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager

import ray
from ray.dag import InputNode, MultiOutputNode
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shared.config import EngineConfig
from shared.errors import ModelLoadError, WorkerError
from shared.logging import get_logger
from shared.step import StepBatch, StepResult
from workers.device import resolve_device
from workers.rank_worker import Park, RankInfo, RankWorker

STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0  # for each rank to leave its process group when the group stops
# No step for this long: the ranks stop spinning (park). Longer than any gap between the
# steps of a busy scheduler; short enough that an idle group costs nothing.
PARK_AFTER_S = 0.05
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
# Named placement groups live in a Ray namespace: the autoscaler reserves a replica's group
# there by name, and the replica's scheduler (another Ray job) finds it there.
RAY_NAMESPACE = "tokenfleet"


def ensure_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Join the cluster at `address`, or start a local Ray, unless this process already did."""
    if ray.is_initialized():
        return
    if address:
        try:
            ray.init(address=address, namespace=RAY_NAMESPACE, include_dashboard=False,
                     log_to_driver=False)
        except ConnectionError as exc:
            raise WorkerError(f"cannot join the Ray cluster at {address}: {exc}") from None
    else:
        # "local": never attach to a cluster some earlier `ray start` left recorded in /tmp/ray.
        ray.init(address="local", num_cpus=num_cpus or max(4, os.cpu_count() or 1), include_dashboard=False,
                 log_to_driver=False)


class RayWorkerGroup:
    def __init__(self, config: EngineConfig) -> None:
        if config.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ModelLoadError(
                f"placement strategy {config.placement_strategy!r} is not one of {PLACEMENT_STRATEGIES}"
            )
        self.config = config
        self.log = get_logger("tokenfleet.worker_group")
        self.step_timeout_s = config.step_timeout_s
        self.park_after_s = PARK_AFTER_S
        # Held by a step, by parking and by start/teardown: the compiled graph is driven by
        # one thread at a time. Notified when parking becomes possible again.
        self._lock = threading.Condition()
        self._is_closed = False
        self._can_park = False  # a compiled graph is up and nothing went wrong parking it
        self._park_ref = None  # the in-flight Park execution while the ranks are parked
        self._last_step_at = time.monotonic()
        self.compiled = None
        self.actors: list = []
        self.pgs: list = []  # one placement group per pipeline stage (or the one reserved for us)
        self.num_in_flight = 0  # steps submitted and not yet collected
        self.peak_in_flight = 0  # the most ever in flight at once (a full pipeline: PP)
        self.pipeline_depth = config.pp
        # The rank whose result the scheduler gets: rank 0 of the last pipeline stage.
        self.driver_rank = (config.pp - 1) * config.tp
        self._wake_socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # to ranks on this host
        self._wake_socket.setblocking(False)
        ensure_ray(config.ray_address)
        self._start()
        self._parker = threading.Thread(target=self._park_when_idle, name="tokenfleet-park", daemon=True)
        self._parker.start()

    # -- life cycle -------------------------------------------------------------------

    def _bundle(self) -> dict[str, float]:
        if resolve_device(self.config.device).type == "cuda":
            return {"GPU": 1, "CPU": 1}
        return {"CPU": self.config.num_cpus_per_rank}

    def _place(self) -> list[tuple[object, int]]:
        """(placement group, bundle index) of every rank, in rank order."""
        tp, pp = self.config.tp, self.config.pp
        if self.config.placement_group_name:
            self.pgs = [_reserved_placement_group(self.config.placement_group_name, tp * pp)]
            spots = [(self.pgs[0], rank) for rank in range(tp * pp)]
        else:
            self.pgs = [placement_group([self._bundle()] * tp, strategy=self.config.placement_strategy)
                        for _ in range(pp)]
            spots = [(self.pgs[rank // tp], rank % tp) for rank in range(tp * pp)]
        if not all(pg.wait(timeout_seconds=60) for pg in self.pgs):
            if not self.config.placement_group_name:
                for pg in self.pgs:
                    remove_placement_group(pg)
            self.pgs = []
            raise ModelLoadError(
                f"Ray could not place {pp} stage(s) of {tp} ranks of {self._bundle()} with "
                f"{self.config.placement_strategy} (cluster resources: {ray.cluster_resources()})"
            )
        return spots

    def _start(self) -> None:
        start = time.perf_counter()
        tp, pp = self.config.tp, self.config.pp
        spots = self._place()
        threads = self.config.num_threads or max(1, int(self.config.num_cpus_per_rank))
        config = self.config if self.config.num_threads else _with_threads(self.config, threads)
        actor_cls = ray.remote(RankWorker)
        self.actors = [
            actor_cls.options(
                num_cpus=self._bundle().get("CPU", 1), num_gpus=self._bundle().get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle
                ),
                max_restarts=0,
            ).remote(config, rank)
            for rank, (pg, bundle) in enumerate(spots)
        ]
        try:
            addr, port = ray.get(self.actors[0].rendezvous_address.remote(), timeout=STARTUP_TIMEOUT_S)
            self.infos: list[RankInfo] = ray.get(
                [a.load.remote(addr, port) for a in self.actors], timeout=STARTUP_TIMEOUT_S
            )
        except ray.exceptions.RayTaskError as exc:
            self._teardown()
            raise ModelLoadError(f"a rank failed to load the model: {_root_message(exc)}") from None
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            self._teardown()
            raise WorkerError(f"the worker group did not start: {exc}") from None
        self._warn_if_spread()
        with InputNode() as batch:
            dag = MultiOutputNode([a.execute.bind(batch) for a in self.actors])
        with self._lock:
            self.compiled = dag.experimental_compile()
            self.num_in_flight = 0
            self._last_step_at = time.monotonic()
            self._can_park = True
            self._lock.notify_all()
        self.num_kv_blocks = min(info.num_kv_blocks for info in self.infos)
        self.num_host_kv_blocks = min(info.num_host_kv_blocks for info in self.infos)
        self.kv_block_bytes = sum(info.kv_block_bytes for info in self.infos)  # the replica's, all shards
        self.max_model_len = self.infos[0].max_model_len
        self.block_size = self.infos[0].block_size
        self.log.info("worker_group_ready", tp=tp, pp=pp, seconds=round(time.perf_counter() - start, 2),
                      nodes=[info.node_id[:8] for info in self.infos],
                      pids=[i.pid for i in self.infos], num_kv_blocks=self.num_kv_blocks)

    def _warn_if_spread(self) -> None:
        for stage in range(self.config.pp):
            hosts = {info.node_id or info.hostname for info in self.infos if info.stage == stage}
            if self.config.tp > 1 and len(hosts) > 1:
                self.log.warning("tp_ranks_on_several_nodes", stage=stage, hosts=sorted(hosts),
                                 hint="every layer all-reduces across the network; expect slow steps; "
                                      "split across nodes with pipeline stages (--pp) instead")

    def restart(self) -> None:
        """Tear the (broken) group down and build a new one with fresh KV caches."""
        self._teardown()
        self._start()

    def _teardown(self) -> None:
        with self._lock:
            self._can_park = False
            if self._park_ref is not None:
                try:
                    self._unpark(STOP_TIMEOUT_S)
                except Exception as exc:  # noqa: BLE001 - a broken group is torn down all the same
                    self.log.warning("unpark_failed", error=str(exc))
            self._leave_process_group()
            compiled, self.compiled = self.compiled, None
            if compiled is not None:
                try:
                    compiled.teardown(kill_actors=True)
                except Exception as exc:  # noqa: BLE001 - a broken graph must not block the rebuild
                    self.log.warning("compiled_graph_teardown_failed", error=str(exc))
            for actor in reversed(self.actors):  # rank 0, the TCPStore's server, last
                ray.kill(actor, no_restart=True)
            self.actors = []
            if not self.config.placement_group_name:
                for pg in self.pgs:
                    remove_placement_group(pg)
            self.pgs = []
            self.num_in_flight = 0

    def _leave_process_group(self) -> None:
        """Every rank frees its model and leaves torch.distributed, all at once; a rank that
        is dead or stuck is not waited for longer than STOP_TIMEOUT_S (it is killed next)."""
        refs = [actor.shutdown.remote() for actor in self.actors]
        if not refs:
            return
        done, not_done = ray.wait(refs, num_returns=len(refs), timeout=STOP_TIMEOUT_S)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:  # a dead rank, on the way to a rebuild
                self.log.info("rank_shutdown_failed", error=type(exc).__name__)
        if not_done:
            self.log.warning("ranks_did_not_shut_down", num_ranks=len(not_done), timeout_s=STOP_TIMEOUT_S)

    def shutdown(self) -> None:
        """Stop every rank (their device memory freed, the process group left) and the
        parking thread. Idempotent."""
        with self._lock:
            self._is_closed = True
            self._lock.notify_all()
        self._parker.join()
        self._teardown()
        self._wake_socket.close()

    # -- parking ----------------------------------------------------------------------

    def _park_when_idle(self) -> None:
        """The parking thread: park the ranks once no step has come for park_after_s."""
        with self._lock:
            while not self._is_closed:
                if not self._can_park or self._park_ref is not None or self.num_in_flight:
                    self._lock.wait()  # until a step (or a new graph) makes parking possible
                    continue
                idle_s = time.monotonic() - self._last_step_at
                if idle_s < self.park_after_s:
                    self._lock.wait(self.park_after_s - idle_s)
                    continue
                try:
                    self._park_ref = self.compiled.execute(Park())
                except Exception as exc:  # noqa: BLE001 - the next step fails the same way, and restarts
                    self.log.warning("park_failed", error=str(exc))
                    self._can_park = False

    def _unpark(self, timeout_s: float) -> None:
        """Wake parked ranks and collect their Park execution (caller holds the lock)."""
        park_ref, self._park_ref = self._park_ref, None
        wake_calls = []
        for actor, info in zip(self.actors, self.infos, strict=True):
            try:
                self._wake_socket.sendto(b"w", info.wake_address)
            except OSError:  # no such socket here: the rank is on another host (or dead)
                wake_calls.append(actor.wake.remote())
        ray.get(park_ref, timeout=timeout_s)
        ray.get(wake_calls, timeout=timeout_s)
        self._lock.notify_all()  # the parking thread starts timing the idle gap again

    @property
    def is_parked(self) -> bool:
        return self._park_ref is not None

    # -- steps ------------------------------------------------------------------------

    def submit(self, batch: StepBatch) -> tuple[int, object]:
        """Start a step on every rank; returns its handle for `collect`."""
        # The sampling rank is another process and the matchers stay here: the grammar mask is
        # filled before the batch goes (not overlapped with the forward, as in process).
        batch.resolve_token_mask()
        with self._lock:
            with _worker_errors(batch.step_id):
                if self._park_ref is not None:
                    self._unpark(self.step_timeout_s)
                ref = self.compiled.execute(batch)
            self.num_in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.num_in_flight)
            self._last_step_at = time.monotonic()
            return batch.step_id, ref

    # A rank runs each step to its end, its mask sent with the batch: no step samples late
    # (the scheduler then keeps a grammar's request out of the step ahead).
    samples_late = False

    def sample(self, handle: tuple[int, object]) -> None:
        """Nothing: every step here was sampled as it ran."""

    def collect(self, handle: tuple[int, object]) -> StepResult:
        """The result of a submitted step (collected in submission order)."""
        step_id, ref = handle
        try:
            with _worker_errors(step_id):
                results = ray.get(ref, timeout=self.step_timeout_s)
        finally:
            with self._lock:
                self.num_in_flight = max(0, self.num_in_flight - 1)
                self._last_step_at = time.monotonic()
                self._lock.notify_all()  # the parking thread may start timing the idle gap
        return results[self.driver_rank]

    def rank_weight_bytes(self) -> list[int]:
        return [info.weight_bytes for info in self.infos]

    def rank_pids(self) -> list[int]:
        return [info.pid for info in self.infos]


@contextmanager
def _worker_errors(step_id: int):
    """Ray's ways of saying a rank failed or vanished, as one WorkerError."""
    try:
        yield
    except ray.exceptions.RayTaskError as exc:
        raise WorkerError(f"step {step_id} failed on a rank: {_root_message(exc)}") from None
    except (ray.exceptions.RayActorError, ray.exceptions.RayChannelError,
            ray.exceptions.GetTimeoutError, ray.exceptions.RaySystemError) as exc:
        raise WorkerError(f"step {step_id}: the worker group failed ({type(exc).__name__})") from None


def _reserved_placement_group(name: str, num_ranks: int):
    try:
        pg = ray.util.get_placement_group(name)
    except ValueError:
        raise ModelLoadError(f"no Ray placement group {name!r} in namespace {RAY_NAMESPACE!r}") from None
    num_bundles = len(ray.util.placement_group_table(pg).get("bundles", {}))
    if num_bundles != num_ranks:
        raise ModelLoadError(f"placement group {name!r} has {num_bundles} bundles for {num_ranks} ranks")
    return pg


def _with_threads(config: EngineConfig, threads: int) -> EngineConfig:
    import dataclasses

    return dataclasses.replace(config, num_threads=threads)


def _root_message(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    if cause is not None:
        return getattr(cause, "message", None) or str(cause)
    return str(exc).splitlines()[0]
