"""Chaos under load: `tokenfleet up` serves mixed traffic while processes are killed at random;
then every promise of the fleet is checked.

    PYTHONPATH=. python scripts/chaos.py --minutes 30                  # by hand, the long run
    PYTHONPATH=. python scripts/chaos.py --minutes 0.5 --fault-interval-s 4 --short   # the suite

1. The reference: every prompt run greedily, undisturbed, by the engine in this process.
2. The fleet: `tokenfleet up` (2 scheduler replicas, 2 gateway processes, a batch ingester of
   its own; `--short`: 1 replica) on a tiny random llama with SmolLM2's tokenizer (`--model`
   for another), leases of a few seconds so that takeovers happen within the run.
3. Load (testkit/chaos/clients.py): SSE streams, resumable event streams read with
   Last-Event-ID reconnects, submit-and-poll, cancels, clients that disconnect, and batch jobs.
4. Faults, every --fault-interval-s on average: kill -9 of a scheduler, a gateway worker, the
   gateway's parent, the batch ingester, a rank worker (--tp 2, a Ray group), or Redis (which
   `up` restarts from its append-only file; with --redis-cluster N, a primary of the cluster,
   whose replica is promoted while `up` restarts the node as a replica).
5. Checks, after the load drained: every accepted request ended exactly once, completed ones
   with the reference's greedy output; no event stream with a gap or a repeat; each batch line
   written once, with the reference's output; nothing left pending in any consumer group; no
   dead letters; the RSS growth of every process under `up`, sampled through the run.

It prints a report and exits 1 on any violation (RSS growth over --max-rss-growth-mb included).
scripts/chaos.py runs `main`; tests/test_chaos.py runs that script, and its checks alone.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil
import redis

from protocol.keys import keys_for
from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.net import free_port
from shared.redis_client import connect, connect_node
from shared.sampling import SamplingParams
from testkit.chaos.checks import (
    Report,
    check_request,
    check_rss,
    fleet_keys,
    pending_details,
    use_keys,
    wait_batch,
    wait_no_pending,
)
from testkit.chaos.clients import KINDS, Client, Outcome
from testkit.checkpoints import tiny_llama_with_smollm2_tokenizer
from testkit.processes import Children
from testkit.runs import log
from tokenfleet.supervise import RestartPolicy

KIND_WEIGHTS = {"stream": 3, "resume": 3, "poll": 2, "cancel": 1, "disconnect": 1}
MIN_VICTIM_AGE_S = RestartPolicy().min_uptime_s + 2.0
RSS_MIN_SPAN_S = 120.0  # RSS growth is judged in processes watched this long (a short run only reports)


# -- the fleet's processes ---------------------------------------------------------------------


def _role(proc: psutil.Process) -> str | None:
    """What a process under `up` is, by its command line (None: not one we watch or kill)."""
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return None
    if "redis-server" in cmd:
        return "redis-primary" if "[cluster]" in cmd and _is_primary(proc) else "redis"
    if "RankWorker" in cmd:
        return "rank"
    if "tokenfleet.cli scheduler" in cmd:
        return "scheduler"
    if "tokenfleet.cli gateway" in cmd:
        return "gateway"
    if "tokenfleet.cli batch ingester" in cmd:
        return "ingester"
    if "multiprocessing" in cmd and "resource_tracker" not in cmd:
        try:
            parent = proc.parent()
            return "gateway-worker" if parent is not None and _role(parent) == "gateway" else None
        except psutil.Error:
            return None
    return None


def _is_primary(proc: psutil.Process) -> bool:
    """Whether a Redis Cluster node (`redis-server host:port [cluster]`) is a primary now."""
    try:
        address = re.search(r"(\d+\.\d+\.\d+\.\d+):(\d+)", " ".join(proc.cmdline()))
        if address is None:
            return False
        role = connect_node(address[1], int(address[2]), socket_timeout=2).execute_command("ROLE")[0]
        return role in (b"master", "master")
    except (psutil.Error, redis.RedisError):
        return False


def fleet_processes(up_pid: int) -> dict[int, tuple[str, psutil.Process]]:
    """pid -> (role, process) of every process under `up` that has a role."""
    found = {}
    for proc in psutil.Process(up_pid).children(recursive=True):
        role = _role(proc)
        if role is not None:
            found[proc.pid] = (role, proc)
    return found


@dataclass
class RssWatch:
    """The RSS of every process under `up`, sampled through the run. A process's first sample
    is taken once it has lived settle_s (its start-up, slow on a loaded machine, is not
    growth); its growth is its last sample minus that one, over however long it then lived
    (kills cut many lives short)."""

    up_pid: int
    settle_s: float = 60.0
    first: dict[int, tuple[str, float, float]] = field(default_factory=dict)  # pid -> (role, time, MB)
    last: dict[int, tuple[float, float]] = field(default_factory=dict)  # pid -> (time, MB)

    def sample(self) -> None:
        now = time.monotonic()
        for pid, (role, proc) in fleet_processes(self.up_pid).items():
            try:
                if time.time() - proc.create_time() < self.settle_s:
                    continue
                mb = proc.memory_info().rss / 2**20
            except psutil.Error:
                continue
            self.first.setdefault(pid, (role, now, mb))
            self.last[pid] = (now, mb)

    async def run(self, until: float, interval_s: float = 5.0) -> None:
        while time.monotonic() < until:
            self.sample()
            await asyncio.sleep(interval_s)
        self.sample()


@dataclass
class Faults:
    up_pid: int
    roles: list[str]
    rng: random.Random
    injected: list[tuple[float, str, int]] = field(default_factory=list)  # (time, role, pid)

    def inject(self) -> None:
        victims = collections.defaultdict(list)
        for pid, (role, proc) in fleet_processes(self.up_pid).items():
            try:
                age_s = time.time() - proc.create_time()
            except psutil.Error:
                continue
            # Kills of a process that has just been restarted are `up`'s repeated fast failures,
            # which end in giving up by design: victims are older than its min_uptime_s.
            if role in self.roles and age_s > MIN_VICTIM_AGE_S:
                victims[role].append(pid)
        if not victims:
            return
        # Each role in turn, in a random order: every kind of process dies within a short run.
        counts = collections.Counter(role for _, role, _ in self.injected)
        fewest = min(counts[role] for role in victims)
        role = self.rng.choice(sorted(role for role in victims if counts[role] == fewest))
        pid = self.rng.choice(victims[role])
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.injected.append((time.time(), role, pid))
        log(f"fault: kill -9 {role} (pid {pid})")

    async def run(self, until: float, interval_s: float) -> None:
        while True:
            await asyncio.sleep(self.rng.uniform(0.5, 1.5) * interval_s)
            if time.monotonic() >= until:
                return
            self.inject()


# -- load -----------------------------------------------------------------------------------------


async def run_load(client: Client, until: float, concurrency: int, rng: random.Random) -> list[Outcome]:
    outcomes: list[Outcome] = []
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())

    async def one_caller(seed: int) -> None:
        own = random.Random(seed)
        while time.monotonic() < until:
            kind = own.choices(kinds, weights)[0]
            outcomes.append(await client.run(kind, own.randrange(len(client.prompts)), own))
            await asyncio.sleep(own.uniform(0.0, 0.3))

    await asyncio.gather(*(one_caller(rng.randrange(1 << 30)) for _ in range(concurrency)))
    return outcomes


def submit_batch(client: redis.Redis, job_id: str, model: str, prompts: list[list[int]],
                 max_tokens: list[int]) -> list[str]:
    lines, custom_ids = [], []
    for index, prompt in enumerate(prompts):
        custom_id = f"line-{index}"
        custom_ids.append(custom_id)
        lines.append(json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                                 "body": {"model": model, "prompt": prompt, "max_tokens": max_tokens[index],
                                          "temperature": 0, "ignore_eos": True}}))
    while True:  # Redis may be down (or come back) right now
        try:
            client.xadd(fleet_keys().batch_in, {"job_id": job_id, "lines": "\n".join(lines)})
            return custom_ids
        except redis.ConnectionError:
            time.sleep(0.5)


async def submit_batches(client: redis.Redis, model: str, prompts: list[list[int]], max_tokens: list[int],
                         until: float, interval_s: float, prefix: str) -> list[tuple[str, list[str]]]:
    """A batch job of every prompt now, and another every interval_s until `until`:
    [(job id, custom ids)]."""
    jobs = []
    while True:
        job_id = f"{prefix}-{len(jobs)}"
        custom_ids = await asyncio.to_thread(submit_batch, client, job_id, model, prompts, max_tokens)
        jobs.append((job_id, custom_ids))
        if time.monotonic() + interval_s >= until:
            return jobs
        await asyncio.sleep(interval_s)


# -- the run --------------------------------------------------------------------------------------


def make_prompts(rng: random.Random, num_prompts: int, vocab_size: int, max_tokens: tuple[int, int]):
    prompts = [[rng.randrange(100, vocab_size) for _ in range(rng.randint(4, 48))]
               for _ in range(num_prompts)]
    return prompts, [rng.randint(*max_tokens) for _ in range(num_prompts)]


def reference(model: Path, prompts: list[list[int]],
              max_tokens: list[int]) -> tuple[list[str], list[list[int]]]:
    """Every prompt, greedy, undisturbed, in this process."""
    with LLMEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=1024)) as engine:
        results = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                                            for n in max_tokens])
    return [r.text for r in results], [list(r.token_ids) for r in results]


def start_fleet(args: argparse.Namespace, model: Path, home: Path, children: Children) -> str:
    port = free_port()
    os.environ.update(  # the fleet's children read their flags' defaults from these
        TOKENFLEET_HOME=str(home), TOKENFLEET_LEASE_S=str(args.lease_s),
        TOKENFLEET_BATCH_LEASE_S=str(args.lease_s), TOKENFLEET_MAX_DELIVERIES=str(args.max_deliveries))
    children.spawn("up", [
        sys.executable, "-m", "tokenfleet.cli", "up", "--port", str(port), "--model", str(model),
        "--dtype", "float32", "--num-kv-blocks", "512", "--max-num-seqs", "16", "--tp", str(args.tp),
        "--replicas", str(args.replicas), "--gateway-workers", str(args.gateway_workers),
        "--batch-ingesters", "1",
        *(["--redis-cluster", str(args.redis_cluster)] if args.redis_cluster else []),
    ])
    return f"http://127.0.0.1:{port}"


async def wait_ready(url: str, children: Children, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            children.check()
            try:
                async with session.get(url + "/ready", timeout=aiohttp.ClientTimeout(total=2)) as response:
                    if response.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the fleet was not ready within {timeout_s:.0f} s")
            await asyncio.sleep(0.3)


async def recorded_fleet(home: Path, children: Children, timeout_s: float = 60.0) -> dict:
    """fleet.json, which `up` writes just after the gateway first answers /ready."""
    deadline = time.monotonic() + timeout_s
    while True:
        children.check()
        try:
            return json.loads((home / "fleet.json").read_text())
        except (OSError, json.JSONDecodeError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def chaos(args: argparse.Namespace, children: Children, workdir: Path) -> Report:
    rng = random.Random(args.seed)
    model = tiny_llama_with_smollm2_tokenizer(workdir / "chaos-tiny-llama") if args.model is None \
        else Path(args.model)
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(model).vocab_size
    prompts, max_tokens = make_prompts(rng, args.num_prompts, vocab_size, (8, 16) if args.short else (8, 32))
    log(f"reference: {len(prompts)} prompts, greedy, in-process")
    want_texts, want_ids = reference(model, prompts, max_tokens)

    url = start_fleet(args, model, workdir / "home", children)
    await wait_ready(url, children)
    up_pid = children.pid("up")
    roles_now = collections.Counter(role for role, _ in fleet_processes(up_pid).values())
    log(f"fleet up at {url}: {dict(roles_now)}")
    report = Report()
    # On a cluster the Redis victims are primaries (each replica is promoted; the killed node is
    # restarted by `up` and rejoins as a replica); on one server, the one Redis.
    roles = ["scheduler", "gateway-worker", "gateway", "ingester",
             "redis-primary" if args.redis_cluster else "redis"]
    roles += ["rank"] if args.tp > 1 else []
    faults = Faults(up_pid, roles, random.Random(args.seed + 1))
    redis_url = (await recorded_fleet(workdir / "home", children))["redis_url"]
    store = connect(redis_url)
    use_keys(keys_for(redis_url))
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        client = Client(session, url, model.name, prompts, max_tokens)
        outcomes = await run_load(client, time.monotonic() + args.warmup_s, args.concurrency, rng)
        rss = RssWatch(up_pid)
        log(f"chaos for {args.minutes:g} min: faults every ~{args.fault_interval_s:g} s among {roles}")
        until = time.monotonic() + args.minutes * 60
        load = run_load(client, until, args.concurrency, rng)
        batches = submit_batches(store, model.name, prompts, max_tokens, until, args.batch_interval_s,
                                 f"chaos-{args.seed}")
        outcomes_now, jobs, *_ = await asyncio.gather(load, batches, faults.run(until, args.fault_interval_s),
                                                      rss.run(until))
        outcomes += outcomes_now
        log("load over; waiting for the fleet to settle")
        await wait_ready(url, children)
        views, problems = await verify_requests(client, outcomes, want_texts, want_ids, args.drain_s, report)
        rss.sample()
    batch_problems = []
    for job_id, custom_ids in jobs:
        batch_problems += await asyncio.to_thread(wait_batch, store, job_id, custom_ids, want_texts,
                                                  args.drain_s)
    for problem in batch_problems:
        report.violation(problem)
    left = await asyncio.to_thread(wait_no_pending, store, model.name, 60.0)
    if left:
        report.violation(f"entries left pending: {left}")
        for line in pending_details(store, model.name):
            report.add("  pending " + line)
    dead = store.xlen(fleet_keys().dead)
    if dead:
        report.violation(f"{dead} dead-lettered entries")
    summarize(report, outcomes, views, problems, faults)
    report.add(f"batch: {len(jobs)} jobs, {sum(len(ids) for _, ids in jobs)} lines, problems: "
               f"{len(batch_problems)}; pending left: {left or 0}; dead letters: {dead}")
    check_rss(rss.first, rss.last, args.max_rss_growth_mb, RSS_MIN_SPAN_S, report)
    return report


async def verify_requests(client: Client, outcomes: list[Outcome], want_texts: list[str],
                          want_ids: list[list[int]], drain_s: float,
                          report: Report) -> tuple[dict[str, dict], collections.Counter]:
    """Wait for every accepted request's end and check it: (req_id -> its view, problem counts)."""
    views, problems = {}, collections.Counter()
    for out in outcomes:
        if out.req_id is None:
            continue
        try:
            views[out.req_id] = await client.wait_status(out.req_id, timeout_s=drain_s)
        except Exception as exc:  # noqa: BLE001 - a request that never ended
            report.violation(f"{out.kind} request {out.req_id} did not end: {exc}")
            problems["lost"] += 1
            continue
        for problem in check_request(out, views[out.req_id], want_texts[out.prompt_index],
                                     want_ids[out.prompt_index]):
            report.violation(f"{out.kind} request {out.req_id}: {problem}")
            problems["wrong"] += 1
    return views, problems


def summarize(report: Report, outcomes: list[Outcome], views: dict[str, dict], problems: collections.Counter,
              faults: Faults) -> None:
    by_kind = collections.Counter(out.kind for out in outcomes if out.req_id is not None)
    not_accepted = [out for out in outcomes if out.req_id is None]
    states = collections.Counter(view["status"] for view in views.values())
    reconnects = sum(out.num_reconnects for out in outcomes)
    fault_counts = collections.Counter(role for _, role, _ in faults.injected)
    report.add(f"faults injected: {len(faults.injected)} ({_counts(fault_counts, sorted(fault_counts))})")
    report.add(f"requests accepted: {sum(by_kind.values())} ({_counts(by_kind, KINDS)}); "
               f"not accepted (client gave up): {len(not_accepted)}")
    report.add(f"ended: {dict(states)}; lost: {problems['lost']}; with wrong, duplicated or missing tokens: "
               f"{problems['wrong']}")
    report.add(f"event streams resumed with Last-Event-ID: {reconnects} reconnects; "
               f"broken SSE completions: {sum(out.is_broken for out in outcomes)}")
    for out in not_accepted[:5]:
        report.add(f"  not accepted: {out.kind}: {out.errors[-1:]}")


def _counts(counter: collections.Counter, names) -> str:
    return ", ".join(f"{name} {counter[name]}" for name in names)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long faults are injected")
    parser.add_argument("--short", action="store_true",
                        help="the suite's version: one replica, short outputs")
    parser.add_argument("--model",
                        help="model folder (default: a tiny random llama with SmolLM2's tokenizer)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp", type=int, default=1, help="2: Ray groups, and rank workers among the victims")
    parser.add_argument("--replicas", type=int, help="schedulers (default 2; --short: 1)")
    parser.add_argument("--gateway-workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, help="clients at once (default 6; --short: 4)")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--fault-interval-s", type=float,
                        help="mean seconds between faults (default 15; --short: 8)")
    parser.add_argument("--warmup-s", type=float, help="load before the first fault (default 20; --short: 5)")
    parser.add_argument("--batch-interval-s", type=float, default=120.0,
                        help="a batch job of every prompt at the start and then this often")
    parser.add_argument("--lease-s", type=float, default=3.0, help="schedulers' and ingesters' lease")
    parser.add_argument("--max-deliveries", type=int, default=10,
                        help="deliveries before dead-lettering (each kill of its scheduler is one)")
    parser.add_argument("--drain-s", type=float, default=300.0,
                        help="how long an accepted request may take to end")
    parser.add_argument("--max-rss-growth-mb", type=float, default=100.0)
    parser.add_argument("--redis-cluster", type=int, metavar="N",
                        help="run the fleet on a local Redis Cluster of N primaries (+ N replicas), "
                             "killing primaries among the faults")
    parser.add_argument("--keep", metavar="DIR",
                        help="work in DIR (a new folder) and keep it: the fleet's logs, its Redis files")
    args = parser.parse_args()
    defaults = dict(replicas=(1, 2), concurrency=(4, 6), fault_interval_s=(8.0, 15.0), warmup_s=(5.0, 20.0))
    for name, (short, long) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, short if args.short else long)
    return args


def main() -> int:
    args = parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tokenfleet-chaos-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        (workdir / "logs").mkdir(parents=True)
        children = Children(workdir / "logs")
        try:
            report = asyncio.run(chaos(args, children, workdir))
        finally:
            children.stop()
    print(f"\nchaos report ({args.minutes:g} min of faults, {time.monotonic() - started:.0f} s in all, "
          f"seed {args.seed}, TP={args.tp}, {args.replicas} replica(s), "
          f"{args.gateway_workers} gateway workers"
          f"{f', a Redis Cluster of {args.redis_cluster} primaries' if args.redis_cluster else ''})")
    for line in report.lines:
        print(line)
    print(f"violations: {len(report.violations)}" + "".join(f"\n  - {v}" for v in report.violations[:50]))
    return 1 if report.violations else 0

