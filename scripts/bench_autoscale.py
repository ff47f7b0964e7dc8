"""Elastic replicas against fixed ones: a step load, in one run. Run by hand (not a test):

    .venv/bin/python scripts/bench_autoscale.py [--step-s 30] [--load-factor 4] [--max-replicas 2]

Method. The model is a tiny random llama with SmolLM2's tokenizer (a step costs milliseconds,
so the fleet's behaviour is measured, not the model), unless --model names a folder. Requests
go straight into the Redis stream (no gateway), greedy, --max-tokens each, EOS ignored.
1. A replica's capacity: one `tokenfleet scheduler` process serves a burst of
   8 x --max-num-seqs requests; capacity = requests / seconds until the stream is empty.
2. The same step load for each fleet: --idle-s with nothing, then --step-s at --load-factor x
   that capacity (evenly spaced arrivals), then nothing until every request ended and
   --tail-s more. Fleets: fixed 1 replica, fixed 2 replicas, and the autoscaler (1 to
   --max-replicas, the controller of `tokenfleet up --min-replicas`, scheduler processes).
Queue wait = the scheduler's start of a request (tf:res started_at) minus its arrival time.
Replicas over time: live heartbeats that are not draining, sampled every 0.5 s; replica-seconds
is their integral over the run (what the fleet held).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import redis

from protocol.keys import Keys
from testkit.checkpoints import tiny_llama_with_smollm2_tokenizer
from testkit.processes import Children
from testkit.redis_queue import KEYS, read_results, submit_requests, wait_drained
from testkit.runs import log, percentile, print_command
from testkit.workloads import greedy
from tokenfleet.autoscale.controller import AutoscaleController
from tokenfleet.autoscale.launcher import ProcessReplicaLauncher
from tokenfleet.autoscale.policy import ScalingPolicy
from tokenfleet.autoscale.signals import read_heartbeats
from tokenfleet.redis_server import RedisServer

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


def scheduler_argv(args: argparse.Namespace, model: str, redis_url: str):
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


def measure_capacity(args: argparse.Namespace, client: redis.Redis, children: Children, argv_for) -> float:
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


def fixed_run(args, client, argv_for, log_dir: Path, num_replicas: int, rate: float) -> Run:
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


def autoscaled_run(args, client, argv_for, log_dir: Path, rate: float) -> Run:
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


def print_table(runs: list[Run], capacity: float, rate: float, args: argparse.Namespace) -> None:
    base = runs[0]
    print(f"\nreplica capacity {capacity:.2f} req/s ({args.max_tokens} tokens each, --max-num-seqs "
          f"{args.max_num_seqs}); step {args.step_s:g} s at {rate:.2f} req/s ({args.load_factor:g}x)")
    print(f"{'fleet':<16} {'requests':>8} {'wait p50 s':>10} {'wait p99 s':>10} {'p99 vs fixed 1':>15} "
          f"{'replica-s':>10} {'peak':>5}")
    for run in runs:
        p50, p99 = percentile(run.waits, 50), percentile(run.waits, 99)
        ratio = p99 / percentile(base.waits, 99) if percentile(base.waits, 99) else float("nan")
        peak = max((n for _, n in run.replicas), default=0)
        print(f"{run.name:<16} {len(run.waits):>8} {p50:>10.2f} {p99:>10.2f} {ratio:>15.2f} "
              f"{run.replica_seconds:>10.0f} {peak:>5}")
    print("\nreplicas over time (most serving per 2 s; the step starts at "
          f"{args.idle_s:g} s and ends at {args.idle_s + args.step_s:g} s):")
    for run in runs:
        print(f"  {run.name:<16} {run.timeline(2.0)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: a tiny llama with SmolLM2's tokenizer)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=4, help="slots per replica")
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--step-s", type=float, default=30.0)
    parser.add_argument("--tail-s", type=float, default=20.0, help="idle after the last request ended")
    parser.add_argument("--load-factor", type=float, default=4.0,
                        help="the step's rate, x one replica's capacity")
    parser.add_argument("--max-replicas", type=int, default=2)
    parser.add_argument("--target-queue", type=float, default=4.0)
    parser.add_argument("--target-wait-s", type=float, default=2.0)
    parser.add_argument("--scale-up-cooldown-s", type=float, default=2.0)
    parser.add_argument("--scale-down-cooldown-s", type=float, default=10.0)
    args = parser.parse_args()
    print_command()
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
    print_table(runs, capacity, rate, args)
    print(f"(logs in {work})")


if __name__ == "__main__":
    main()
