"""The paths scripts/bench_fleet_gpu.py times, the same burst through each: (a) the in-process
engine, (b) Redis streams -> a `tokenfleet scheduler` process, (c) SSE clients -> a `tokenfleet
gateway` -> Redis -> that scheduler; each gives a PathResult (output tokens and time, TTFT and
ITL samples, CPU seconds per process, errors). The script's docstring says how each is timed;
scripts/bench_serve_gpu.py uses the same model and fleet pieces."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import redis
import torch

from protocol.result_record import F
from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from testkit import py_spy
from testkit.checkpoints import SMOLLM2_VOCAB_SIZE, tiny_llama_with_smollm2_tokenizer
from testkit.completion_streams import run_streams, run_streams_in_processes
from testkit.engine_runs import run_engine_workload, warm_up
from testkit.processes import Children, CpuMeter, start_gateway, start_redis, start_scheduler
from testkit.random_models import write_llama3_8b_with_smollm2_tokenizer
from testkit.redis_queue import (
    EventListener,
    completion_tokens,
    read_results,
    submit_requests,
    wait_drained,
)
from testkit.runs import log, percentile
from testkit.workloads import Workload, greedy, warmup_prompts

MODEL_NAME = "bench"
SCHEDULER_READY_S = 600.0  # loading 16 GB and capturing CUDA graphs


# -- the model ---------------------------------------------------------------------------------


def prepare_model(args: argparse.Namespace, folder: Path) -> str:
    """Write the checkpoint and the tokenizer into folder; returns a description of the model."""
    tokenizer = Path(args.tokenizer) if args.tokenizer else None
    if args.smoke:
        # A window of 2048 holds the warm-up prompts.
        tiny_llama_with_smollm2_tokenizer(folder, tokenizer, max_position_embeddings=2048)
        return "tiny random llama (2 layers, hidden 64), float32"
    # The scheduler process loads it: the GPU's memory is handed back once it is written.
    num_params = write_llama3_8b_with_smollm2_tokenizer(folder, torch.device(args.device), tokenizer)
    return f"Llama-3-8B shape, vocab {SMOLLM2_VOCAB_SIZE:,} ({num_params / 1e9:.2f} B params), bf16"


@dataclass
class PathResult:
    name: str
    seconds: float = 0.0
    num_output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds while timed
    errors: list[str] = field(default_factory=list)
    failed: str | None = None  # why the path gave no figure
    arrivals: str = ""  # when the requests were queued and started, from their tf:res records

    @property
    def output_rate(self) -> float | None:
        return self.num_output_tokens / self.seconds if self.seconds and not self.failed else None

    def summary(self) -> dict:
        def spread(values: list[float]) -> dict:
            if not values:
                return {"p50": None, "p99": None, "count": 0}
            return {"p50": percentile(values, 50), "p99": percentile(values, 99), "count": len(values)}

        return {"name": self.name, "seconds": self.seconds, "num_output_tokens": self.num_output_tokens,
                "output_tok_per_s": self.output_rate, "ttft_s": spread(self.ttft_s),
                "itl_s": spread(self.itl_s), "cpu_s": self.cpu_s,
                "cpu_us_per_token": {name: 1e6 * s / max(self.num_output_tokens, 1)
                                     for name, s in self.cpu_s.items()},
                "num_errors": len(self.errors), "errors": self.errors[:10], "failed": self.failed,
                "arrivals": self.arrivals}


def failed_path(name: str, exc: BaseException) -> PathResult:
    traceback.print_exc()
    first_line = str(exc).splitlines()[0][:300] if str(exc) else ""
    return PathResult(name, failed=f"{type(exc).__name__}: {first_line}")


def itl_gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


# Each path first runs the whole workload's prompts for this many tokens, untimed: the burst's
# step shapes compile their kernels then (Triton specialises per shape), not in the timed run.
# Without it the path measured first paid the compiles (queue 0.86 of the engine, then HTTP 1.03).
WARMUP_BURST_TOKENS = 4


def shifted(prompts: list[list[int]], by: int) -> list[list[int]]:
    """The same lengths with other ids: no block in common with the prompts, for the prefix cache."""
    return [[(t + by) % SMOLLM2_VOCAB_SIZE for t in prompt] for prompt in prompts]


def warmup_burst(workload: Workload, path: str) -> list[list[int]]:
    """A path's warm-up prompts: the workload's lengths, sharing no block with any timed run."""
    return shifted(workload.prompts, {"engine": 7, "queue": 7, "http": 19}[path])


def http_prompts(workload: Workload, client_processes: int) -> list[list[int]]:
    """(c) shares its scheduler with (b), whose prefix cache holds (b)'s prompts once it has run:
    each (c) run times prompts of the same lengths with other ids, or it would measure cache hits
    (an HTTP path faster than the engine: TTFT p50 366 against the queue path's 1,232 ms on the H200)."""
    return shifted(workload.prompts, 13 + 4 * (client_processes - 1))



# -- the fleet: Redis, the scheduler, the gateway ----------------------------------------------


def start_fleet_scheduler(args: argparse.Namespace, children: Children, redis_url: str, folder: Path) -> None:
    flags = ["--model-name", MODEL_NAME, "--device", args.device, "--dtype", args.dtype,
             "--max-num-seqs", str(args.max_num_seqs), "--cuda-graph-max-batch-size", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--tp", str(args.tp),
             "--pp", str(args.pp)]
    if args.executor:
        flags += ["--executor", args.executor]
    start_scheduler(children, redis_url, folder, *flags, scheduler_id=f"bench-{os.getpid()}",
                    ready_s=SCHEDULER_READY_S)


def start_fleet_gateway(args: argparse.Namespace, children: Children, redis_url: str, folder: Path) -> str:
    flags = ["--model-name", MODEL_NAME, "--max-queue", "0"]  # all at once: no 429s
    if args.gateway_workers:
        flags += ["--workers", str(args.gateway_workers)]
    return start_gateway(children, redis_url, folder, *flags)[0]


# -- (b) queue -------------------------------------------------------------------------------------


def check_records(client: redis.Redis, req_ids: list[str], max_tokens: list[int]) -> list[str]:
    errors = []
    for (req_id, record), wanted in zip(read_results(client, req_ids).items(), max_tokens, strict=True):
        state, got = record.get(b"state"), completion_tokens(record)
        if state != b"completed" or got != wanted:
            errors.append(f"{req_id}: state {state!r}, {got} tokens of {wanted}")
    return errors


def arrivals_note(client: redis.Redis, req_ids: list[str], max_tokens: list[int], start_wall: float) -> str:
    """When a path's requests reached the queue and the engine, after the path's start (wall
    clock, as the records' times): a burst's time ends with its longest requests, so a longest
    request started late makes the whole path late."""
    records = read_results(client, req_ids)

    def after(field_name: bytes, which: list[str]) -> float | None:
        times = [float(records[r][field_name]) for r in which if field_name in records[r]]
        return 1e3 * (max(times) - start_wall) if times else None

    longest = [r for r, m in zip(req_ids, max_tokens, strict=True) if m == max(max_tokens)]
    queued_at, started_at = F.QUEUED_AT.encode(), F.STARTED_AT.encode()
    parts = {"last queued": after(queued_at, req_ids), "last started": after(started_at, req_ids),
             f"last {max(max_tokens)}-token request started": after(started_at, longest)}
    return "; ".join(f"{name} +{ms:,.0f} ms" for name, ms in parts.items() if ms is not None)


def run_queue_path(args: argparse.Namespace, children: Children, redis_url: str, redis_port: int,
                   workload: Workload, meter: CpuMeter, profiles: PathProfiles, tmp: Path) -> PathResult:
    result = PathResult("(b) Redis stream -> scheduler")
    client = redis.Redis.from_url(redis_url)
    warmup = warmup_prompts(SMOLLM2_VOCAB_SIZE)
    submit_requests(client, MODEL_NAME, warmup, [greedy(8)] * len(warmup))
    wait_drained(client, MODEL_NAME, args.timeout_s, children=children)
    burst = warmup_burst(workload, "queue")
    submit_requests(client, MODEL_NAME, burst, [greedy(WARMUP_BURST_TOKENS)] * len(burst))
    wait_drained(client, MODEL_NAME, args.timeout_s, children=children)
    with EventListener(redis_port, tmp / "listener.pickle") as listener:
        profiles.start("queue")
        meter.start()
        start_wall = time.time()
        req_ids, start = submit_requests(client, MODEL_NAME, workload.prompts,
                                         [greedy(m) for m in workload.max_tokens])
        wait_drained(client, MODEL_NAME, args.timeout_s, children=children)
        result.cpu_s = meter.stop()
        time.sleep(0.5)  # the listener has every event by now
    profiles.wait()
    events = listener.events()
    result.errors = check_records(client, req_ids, workload.max_tokens)
    result.arrivals = arrivals_note(client, req_ids, workload.max_tokens, start_wall)
    last = start
    for req_id in req_ids:
        with_tokens = [e for e in events.get(req_id, []) if e.num_tokens]
        if not with_tokens:
            result.errors.append(f"{req_id}: no token event seen")
            continue
        times = [e.t for e in with_tokens]
        result.ttft_s.append(times[0] - start)
        result.itl_s += itl_gaps(times)
        result.num_output_tokens += sum(e.num_tokens for e in with_tokens)
        last = max(last, events[req_id][-1].t)
    result.seconds = last - start
    return result


# -- (c) HTTP ----------------------------------------------------------------------------------------


def warm_up_http(args: argparse.Namespace, gateway_url: str, workload: Workload) -> None:
    warmup = warmup_prompts(SMOLLM2_VOCAB_SIZE)
    streams, _ = asyncio.run(run_streams(gateway_url, MODEL_NAME, warmup, [8] * len(warmup), len(warmup),
                                         args.timeout_s))
    burst, _ = asyncio.run(run_streams(gateway_url, MODEL_NAME, warmup_burst(workload, "http"),
                                       [WARMUP_BURST_TOKENS] * len(workload.prompts), args.concurrency,
                                       args.timeout_s))
    if any(s.error for s in [*streams, *burst]):
        raise RuntimeError(f"warm-up failed: {[s.error for s in [*streams, *burst] if s.error][:3]}")


def run_http_path(args: argparse.Namespace, gateway_url: str, redis_url: str, workload: Workload,
                  meter: CpuMeter, profiles: PathProfiles, client_processes: int) -> PathResult:
    """The burst as streamed completions from `client_processes` client processes (1: from this one)."""
    clients = "one client process" if client_processes == 1 else f"{client_processes} client processes"
    result = PathResult(f"(c) SSE clients -> gateway -> Redis -> scheduler, {clients}")
    prompts = http_prompts(workload, client_processes)
    meter.start()
    start_wall = time.time()
    if client_processes == 1:
        profiles.start(f"http{client_processes}")
        streams, start = asyncio.run(run_streams(gateway_url, MODEL_NAME, prompts, workload.max_tokens,
                                                 args.concurrency, args.timeout_s))
    else:  # their CPU is not metered ("this process" is the parent, idle)
        # The profile starts when the processes are let go, not during their imports.
        streams, start, start_wall = run_streams_in_processes(
            gateway_url, MODEL_NAME, prompts, workload.max_tokens, args.concurrency, args.timeout_s,
            client_processes, on_start=lambda: profiles.start(f"http{client_processes}"))
    result.cpu_s = meter.stop()
    profiles.wait()
    result.errors = [s.error for s in streams if s.error]
    ended = [s for s in streams if s.error is None]
    result.seconds = max((s.end for s in ended), default=start) - start
    for s in ended:
        result.num_output_tokens += s.completion_tokens
        result.ttft_s.append(s.chunk_times[0] - s.start)
        result.itl_s += itl_gaps(s.chunk_times)
    seen = [(s.req_id, m) for s, m in zip(streams, workload.max_tokens, strict=True) if s.req_id]
    if seen:
        result.arrivals = arrivals_note(redis.Redis.from_url(redis_url), [r for r, _ in seen],
                                        [m for _, m in seen], start_wall)
    return result


def run_fleet_paths(args: argparse.Namespace, folder: Path, workload: Workload,
                    tmp: Path) -> list[PathResult]:
    """Redis and one scheduler (and the gateway unless --skip-http); (b) then (c); all stopped."""
    results = []
    children = Children(tmp)
    try:
        redis_url, redis_port = start_redis(children, tmp / "redis", appendfsync=args.appendfsync)
        start_fleet_scheduler(args, children, redis_url, folder)
        log("scheduler up")
        pids = {"scheduler": children.pid("scheduler"), "redis-server": children.pid("redis-server"),
                "this process": os.getpid()}
        gateway_url = None
        if not args.skip_http:
            gateway_url = start_fleet_gateway(args, children, redis_url, folder)
            pids["gateway"] = children.pid("gateway")
        meter = CpuMeter(pids)
        profiles = PathProfiles(args, pids)
        if not args.skip_queue:
            results.append(run_path("(b) Redis stream -> scheduler", run_queue_path, args, children,
                                    redis_url, redis_port, workload, meter, profiles, tmp))
        if gateway_url is not None:
            warm_up_http(args, gateway_url, workload)
            for processes in sorted({1, args.client_processes}):
                results.append(run_path(f"(c) SSE clients, {processes} client processes", run_http_path, args,
                                        gateway_url, redis_url, workload, meter, profiles, processes))
    except Exception as exc:  # noqa: BLE001 - a failed path is a row
        results.append(failed_path("fleet (Redis, scheduler, gateway)", exc))
    finally:
        if any(r.failed or r.errors for r in results):
            for name in ("scheduler", "gateway"):
                print(f"--- {name} log (end) ---\n{children.tail(name)}", file=sys.stderr)
        children.stop()
    return results


class PathProfiles:
    """py-spy on the scheduler (with its publishers) and the gateway (with its workers) for
    --py-spy-seconds from a path's timed start, one raw file each; nothing without --py-spy."""

    def __init__(self, args: argparse.Namespace, pids: dict[str, int]) -> None:
        self.folder, self.seconds, self.blocking = args.py_spy, args.py_spy_seconds, args.py_spy_blocking
        self.pids = {role: pid for role, pid in pids.items() if role in ("scheduler", "gateway")}
        self.spies: list[subprocess.Popen] = []

    def start(self, label: str) -> None:
        if self.folder is None or not py_spy.is_available():
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        self.spies = [py_spy.record(pid, self.seconds, self.folder / f"burst_{label}_{role}.txt",
                                      blocking=self.blocking)
                      for role, pid in self.pids.items()]

    def wait(self) -> None:
        for spy in self.spies:
            spy.wait()
        self.spies = []


def run_path(name: str, run, *args) -> PathResult:
    """One fleet path; its failure is a row (the next path may still work)."""
    try:
        result = run(*args)
        log(f"{name}: {result.output_rate or 0:,.0f} output tok/s")
        return result
    except Exception as exc:  # noqa: BLE001
        return failed_path(name, exc)


# -- (a) in-process ------------------------------------------------------------------------------


def run_engine_path(args: argparse.Namespace, folder: Path, workload: Workload) -> PathResult:
    result = PathResult("(a) in-process engine")
    # for_device: the device's defaults for the rest (async scheduling on CUDA), as the fleet's scheduler.
    config = EngineConfig.for_device(torch.device(args.device).type, model=str(folder), device=args.device,
                                     dtype=args.dtype, tp=args.tp, pp=args.pp, max_num_seqs=args.max_num_seqs,
                                     cuda_graph_max_batch_size=args.max_num_seqs,
                                     max_num_batched_tokens=args.max_num_batched_tokens)
    with LLMEngine(config, load_tokenizer_files=False) as engine:
        warm_up(engine, SMOLLM2_VOCAB_SIZE)
        engine.generate(warmup_burst(workload, "engine"), greedy(WARMUP_BURST_TOKENS))
        meter = CpuMeter({"this process": os.getpid()})
        meter.start()
        run = run_engine_workload(engine, workload, args.timeout_s, torch.device(args.device))
        result.cpu_s = meter.stop()
    result.seconds, result.num_output_tokens = run.seconds, run.num_output_tokens
    if run.partial_limit_s is not None:
        result.errors.append(f"stopped at the {args.timeout_s:.0f} s limit")
    for times in run.token_times.values():
        result.ttft_s.append(times[0] - run.start)
        result.itl_s += itl_gaps(times)
    return result
