"""bench_autoscale.py's fleets under one step load: a replica's capacity measured first, then
fixed fleets of 1 and 2 `tokenfleet scheduler` processes and the autoscaler (the controller of
`tokenfleet up --min-replicas`), each under the same idle / step / idle load straight into the
Redis stream; each request's queue wait and the replicas serving over time."""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from protocol.keys import Keys
from testkit.checkpoints import tiny_llama_with_smollm2_tokenizer
from testkit.processes import Children
from testkit.redis_queue import KEYS, read_results, submit_requests, wait_drained
from testkit.runs import log
from testkit.workloads import greedy
from tokenfleet.autoscale.controller import AutoscaleController
from tokenfleet.autoscale.launcher import ProcessReplicaLauncher
from tokenfleet.autoscale.policy import ScalingPolicy
from tokenfleet.autoscale.signals import read_heartbeats
from tokenfleet.redis_server import RedisServer

ArgvFor = Callable[[str, str | None], list[str]]  # (replica id, group) -> argv
MODEL_NAME = "bench"
PROMPT = list(range(100, 132))  # 32 tokens, the same for every request (the wait is what differs)


@dataclass
class Run:
    name: str
    waits: list[float] = field(default_factory=list)
    replicas: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, serving)

    @property
    def replica_seconds(self) -> float:
        return sum((t1 - t0) * n for (t0, n), (t1, _) in zip(self.replicas, self.replicas[1:], strict=False))

    def timeline(self, bucket_s: float) -> str:
        """The most replicas serving in each bucket, one digit per bucket."""
        end = self.replicas[-1][0] if self.replicas else 0.0
        digits = []
        for start in range(0, int(end) + 1, int(bucket_s)):
            seen = [n for t, n in self.replicas if start <= t < start + bucket_s]
            digits.append(str(max(seen)) if seen else ".")
        return "".join(digits)


def scheduler_argv(args: argparse.Namespace, model: str, redis_url: str) -> ArgvFor:
    """The argv of a replica's `tokenfleet scheduler` process, by replica id (and group)."""

    def argv_for(replica_id: str, group: str | None) -> list[str]:
        return [sys.executable, "-m", "tokenfleet.cli", "scheduler", "--redis-url", redis_url,
                "--model", model, "--model-name", MODEL_NAME, "--scheduler-id", replica_id,
                "--dtype", args.dtype, "--num-kv-blocks", "1024", "--max-num-seqs", str(args.max_num_seqs)]
    return argv_for


def wait_serving(client: redis.Redis, count: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while len([r for r in read_heartbeats(client, KEYS, MODEL_NAME) if not r.is_draining]) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} schedulers did not start within {timeout_s:.0f} s")
        time.sleep(0.2)


def measure_capacity(args: argparse.Namespace, client: redis.Redis, children: Children,
                     argv_for: ArgvFor) -> float:
    children.spawn("capacity", argv_for("capacity-0", None))
    wait_serving(client, 1)
    num = 8 * args.max_num_seqs
    _, start = submit_requests(client, MODEL_NAME, [PROMPT] * num, [greedy(args.max_tokens)] * num)
    wait_drained(client, MODEL_NAME, 1800, children=children)
    seconds = time.monotonic() - start
    children.stop()
    client.flushall()
    return num / seconds


def step_load(args: argparse.Namespace, client: redis.Redis, rate: float, run: Run,
              children: Children | None = None) -> None:
    """Idle, the step at `rate` requests/s, then idle until all ended and the tail passed."""
    t0 = time.monotonic()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            serving = [r for r in read_heartbeats(client, KEYS, MODEL_NAME) if not r.is_draining]
            run.replicas.append((time.monotonic() - t0, len(serving)))
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    time.sleep(args.idle_s)
    arrivals: dict[str, float] = {}
    num = int(rate * args.step_s)
    step_start = time.monotonic()
    for index in range(num):
        time.sleep(max(0.0, step_start + index / rate - time.monotonic()))
        ids, _ = submit_requests(client, MODEL_NAME, [PROMPT], [greedy(args.max_tokens)])
        arrivals[ids[0]] = time.time()
    wait_drained(client, MODEL_NAME, 1800, children=children)
    time.sleep(args.tail_s)
    stop.set()
    sampler.join()
    records = read_results(client, list(arrivals))
    for req_id, arrival in arrivals.items():
        record = records[req_id]
        if record.get(b"state") != b"completed":
            raise RuntimeError(f"request {req_id} ended {record.get(b'state')}")
        run.waits.append(float(record[b"started_at"]) - arrival)


def fixed_run(args: argparse.Namespace, client: redis.Redis, argv_for: ArgvFor, log_dir: Path,
              num_replicas: int, rate: float) -> Run:
    run = Run(f"fixed {num_replicas}")
    children = Children(log_dir)
    try:
        for index in range(num_replicas):
            children.spawn(f"fixed{num_replicas}-{index}", argv_for(f"fixed-{index}", None))
        wait_serving(client, num_replicas)
        step_load(args, client, rate, run, children)
    finally:
        children.stop()
        client.flushall()
    return run


def autoscaled_run(args: argparse.Namespace, client: redis.Redis, argv_for: ArgvFor, log_dir: Path,
                   rate: float) -> Run:
    run = Run(f"autoscale 1-{args.max_replicas}")
    policy = ScalingPolicy(min_replicas=1, max_replicas=args.max_replicas,
                           target_queue_per_replica=args.target_queue, target_wait_s=args.target_wait_s,
                           scale_up_cooldown_s=args.scale_up_cooldown_s,
                           scale_down_cooldown_s=args.scale_down_cooldown_s)
    controller = AutoscaleController(client, Keys(), MODEL_NAME, policy,
                                     ProcessReplicaLauncher(argv_for, log_dir), interval_s=0.5)
    stop = threading.Event()
    thread = threading.Thread(target=controller.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_serving(client, 1)
        step_load(args, client, rate, run)
    finally:
        stop.set()
        thread.join()
        controller.close()
        client.flushall()
    return run


def compare_fleets(args: argparse.Namespace) -> tuple[float, float, list[Run], Path]:
    """One replica's capacity (req/s), the step's rate, the runs of fixed 1, fixed 2 and the
    autoscaler, and the folder holding their logs."""
    work = Path(tempfile.mkdtemp(prefix="bench-autoscale-"))
    model = args.model or str(tiny_llama_with_smollm2_tokenizer(work / "model"))
    server = RedisServer(work / "redis")
    server.start()
    client = server.client()
    argv_for = scheduler_argv(args, model, server.url)
    try:
        capacity = measure_capacity(args, client, Children(work), argv_for)
        rate = args.load_factor * capacity
        log(f"one replica serves {capacity:.2f} req/s; the step sends {rate:.2f} req/s")
        runs = []
        for num_replicas in (1, 2):
            runs.append(fixed_run(args, client, argv_for, work, num_replicas, rate))
            log(f"{runs[-1].name}: done")
        runs.append(autoscaled_run(args, client, argv_for, work, rate))
        log(f"{runs[-1].name}: done")
    finally:
        server.stop()
    return capacity, rate, runs, work
