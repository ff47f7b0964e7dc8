"""The two sides scripts/bench_serve_gpu.py compares under steady arrivals: the fleet
(`tokenfleet up`, loaded by `tokenfleet bench` at each rate: `fleet_rows`) and the in-process
engine fed the same planned chats (`engine_rows`); with the pieces of each (the fleet's TTFT cut
at its records' timestamps, py-spy of its processes). The script's docstring says how each is
timed."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import redis

from gateway.models import ServedModel
from protocol.keys import Keys
from protocol.result_record import F
from shared.net import free_port
from testkit import py_spy
from testkit.arrivals import Chats, ServingRow, run_chats
from testkit.fleet_paths import prepare_model
from testkit.processes import Children, wait_ready
from testkit.result_wait import ResultWaitProbe
from testkit.runs import log, percentile
from tokenfleet import bench as fleet_bench
from tokenfleet.cli import build_parser
from tokenfleet.engine_flags import engine_config

MODEL_NAME = "bench-model"


def bench_args(args: argparse.Namespace, url: str, rate: float,
               json_share: float = 0.0) -> argparse.Namespace:
    """`tokenfleet bench`'s flags for one rate (the engine's plan is drawn from the same)."""
    return argparse.Namespace(
        url=url, model=MODEL_NAME, num_requests=1, duration=args.seconds, rate=rate, concurrency=100_000,
        client_processes=args.client_processes, json_share=json_share,
        prefix_tokens=args.prefix_tokens, prompt_words="40-300", max_tokens="16-512:lognormal:150",
        temperature=0.0, completions=False, api_key=None, seed=0, timeout_s=300.0,
        slo_ttft_ms=None, slo_itl_ms=None)


def fleet_rows(args: argparse.Namespace, folder: Path, rates: list[float], out: Path,
               shares: tuple[float, ...] = (0.0,)) -> dict[tuple[float, float], dict]:
    """(rate, JSON share) -> the fleet's run: at each rate, one run per share (same arrivals)."""
    home = Path(tempfile.mkdtemp(prefix="tokenfleet-serve-home-"))
    os.environ["TOKENFLEET_HOME"] = str(home)
    children = Children(out)
    port = free_port()
    children.spawn("up", [sys.executable, "-m", "tokenfleet.cli", "up", "--model", str(folder),
                          "--model-name", MODEL_NAME, "--port", str(port), *quant_flags(args)])
    summaries: dict[tuple[float, float], dict] = {}
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, children, timeout_s=600)
        log("fleet ready")
        warm = bench_args(args, url, 4.0)
        warm.duration = 2.0
        asyncio.run(fleet_bench.run(warm))
        redis_url = redis_url_of(out / "up.log")
        for rate, share in ((rate, share) for rate in rates for share in shares):
            spies: list[subprocess.Popen] = []  # started with the load (not the clients' imports)
            started: list[float] = []

            def profile(rate=rate, share=share, spies=spies, started=started) -> None:
                started.append(time.monotonic())
                spies.extend(start_py_spy(args, rate, out, share))

            with ResultWaitProbe(redis_url) as probe:
                results, wall, model = asyncio.run(fleet_bench.run(bench_args(args, url, rate, share),
                                                                   on_start=profile))
            # The wait's share while requests arrive (the first second is the ramp).
            gpu_wait = probe.share(started[0] + 1.0, started[0] + args.seconds) if started else None
            summaries[rate, share] = {"results": results, "wall": wall, "gpu_wait": gpu_wait,
                               "ttft_parts": ttft_parts(redis_url, results)}
            for spy in spies:
                spy.wait(timeout=args.seconds + 60)
            ok = [r for r in results if r.ok]
            # Percentiles too, as each engine row logs its own: a run cut short keeps them.
            ttft = [r.first_token - r.started for r in ok if r.first_token is not None]
            itl = [gap for r in ok for gap in r.gaps]
            log(f"fleet {rate:g} req/s{f', {share:.0%} JSON' if share else ''}: {len(ok)}/{len(results)} ok, "
                f"{sum(r.output_tokens for r in ok) / wall:,.0f} tok/s, TTFT p50 / p99 "
                f"{_ms(ttft, 50)} / {_ms(ttft, 99)} ms, ITL p99 {_ms(itl, 99)} ms, "
                f"engine thread waiting on the GPU {share_text(gpu_wait)}")
    finally:
        children.stop()
        shutil.rmtree(home, ignore_errors=True)
    return summaries


def share_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _ms(values: list[float], q: float) -> str:
    return f"{percentile(values, q) * 1e3:,.0f}" if values else "-"


def redis_url_of(up_log: Path) -> str:
    """The fleet's Redis, as `up` announced it."""
    found = re.search(r"Redis (redis://\S+?)\)", up_log.read_text())
    if found is None:
        raise RuntimeError(f"no Redis URL in {up_log}")
    return found.group(1)


TTFT_PARTS = ("gateway", "queue", "engine", "delivery")


def ttft_parts(redis_url: str, results: list, dump: Path | None = None) -> dict[str, list[float]]:
    """Each streamed request's TTFT cut at its record's timestamps (seconds): the gateway (POST
    to queued_at), the queue (to started_at: a scheduler claimed it), the engine (to
    first_token_at: the step that made it was handed to the publisher), and the delivery
    (publisher, Redis, gateway, SSE: to the client's first content chunk). `dump`: a file for
    each request's wall-clock timestamps, to lay beside a step trace (scheduler/step_trace.py)."""
    ok = [r for r in results if r.ok and r.req_id]
    client = redis.Redis.from_url(redis_url)
    pipe = client.pipeline(transaction=False)
    for r in ok:
        pipe.hmget(Keys().result(r.req_id), [F.QUEUED_AT, F.STARTED_AT, F.FIRST_TOKEN_AT])
    parts: dict[str, list[float]] = {name: [] for name in TTFT_PARTS}
    rows = []
    for r, row in zip(ok, pipe.execute(), strict=True):
        if None in row:
            continue
        queued, started, first = (float(v) for v in row)
        for name, value in zip(TTFT_PARTS, (queued - r.started_wall, started - queued, first - started,
                                            r.first_token_wall - first), strict=True):
            parts[name].append(value)
        rows.append({"req_id": r.req_id, "posted": r.started_wall, "queued": queued, "started": started,
                     "first_token": first, "first_chunk": r.first_token_wall})
    client.close()
    if dump is not None:
        dump.write_text(json.dumps(rows))
    return parts


def start_py_spy(args: argparse.Namespace, rate: float, out: Path,
                 share: float = 0.0) -> list[subprocess.Popen]:
    """py-spy on the scheduler (with its publisher) and on the gateway (with its workers)."""
    if args.py_spy is None or rate != args.py_spy_rate or not py_spy.is_available():
        return []
    args.py_spy.mkdir(parents=True, exist_ok=True)
    spies = []
    for role in ("scheduler", "gateway"):
        process = next((p for p in psutil.process_iter(["cmdline"])
                        if {role, "tokenfleet.cli"} <= set(p.info["cmdline"] or [])), None)
        if process is None:
            log(f"no {role} process found: no profile of it")
            continue
        name = f"serve{rate:g}{f'_json{share * 100:g}' if share else ''}_{role}.txt"
        spies.append(py_spy.record(process.pid, args.seconds, args.py_spy / name,
                                    blocking=args.py_spy_blocking))
    return spies


# --engine-ab's runs: label -> the scheduler flags of each (the first is the default config's).
AB_RUNS = {"graphs": {"graphs": [], "eager": ["--cuda-graph-max-tokens", "0"]},
           "async": {"async on": ["--async-scheduling", "on"], "async off": ["--async-scheduling", "off"]}}


def quant_flags(args: argparse.Namespace) -> list[str]:
    """--quantization, --kv-cache-dtype and --max-weight-bytes-per-rank, given to the fleet's `up`
    and to the engine alike."""
    flags = ["--quantization", args.quantization] if args.quantization else []
    if args.max_weight_bytes_per_rank:
        flags += ["--max-weight-bytes-per-rank", args.max_weight_bytes_per_rank]
    return flags + (["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype != "auto" else [])


def write_model(args: argparse.Namespace, folder: Path) -> str:
    """The checkpoint of --model-kind into folder; returns its description."""
    if args.model_kind == "llama8b":
        return prepare_model(args, folder)
    from testkit.qwen_checkpoints import make_qwen_checkpoint, write_qwen_14b

    if args.smoke:  # a window of 2048 holds the smoke's chats; past seq_length 64, logn and NTK work
        make_qwen_checkpoint(folder, max_position_embeddings=2048)
        return "tiny random Qwen (v1) (3 layers, hidden 64, seq_length 64), float32"
    num_params = write_qwen_14b(folder, args.device)
    return (f"Qwen-14B shape (QWenLMHeadModel, {num_params / 1e9:.2f} B params, vocab 152,064, synthetic "
            "qwen.tiktoken of the real size), random bf16 weights")


def engine_rows(args: argparse.Namespace, folder: Path, rates: list[float], *,
                flags: tuple[str, ...] = ()) -> dict[float, ServingRow]:
    from scheduler.engine import LLMEngine

    scheduler_args = build_parser().parse_args(["scheduler", "--model", str(folder), *flags,
                                                *quant_flags(args)])
    config = engine_config(scheduler_args)
    served = ServedModel(MODEL_NAME, str(folder), None, 0, 0)
    rows: dict[float, ServingRow] = {}
    with LLMEngine(config) as engine:
        served.tokenizer = engine.tokenizer
        warm = Chats([0.0] * 4, [engine.encode("warm up the engine", chat=True)] * 4, [8] * 4)
        run_chats(engine, warm, "warm-up")
        for rate in rates:
            planned = fleet_bench.plan_requests(bench_args(args, "", rate), MODEL_NAME)
            chats = Chats([p.arrival for p in planned],
                          [served.encode_chat(p.body["messages"])[1] for p in planned],
                          [p.body["max_tokens"] for p in planned])
            rows[rate] = run_chats(engine, chats, f"engine {rate:g} req/s")
            log(str(rows[rate]))
    return rows
