"""Serving under steady arrivals: the fleet (`tokenfleet up`, no other flags) against the in-process
engine fed the same arrivals, at several rates, in one run (issue 27's table; docs/perf-notes.md).

    python3 scripts/bench_serve_gpu.py --tokenizer DIR          # one H200, ~6 min
    python3 scripts/bench_serve_gpu.py --tokenizer DIR --quantization fp8   # the same with fp8 weights
    .venv/bin/python scripts/bench_serve_gpu.py --smoke         # this CPU, tiny model: checks the script
    python3 scripts/bench_serve_gpu.py --model-kind qwen14b --rates 4,8   # Qwen-14B's shape, bf16
    python3 scripts/bench_serve_gpu.py --model-kind qwen14b --rates 4,8 --quantization fp8 \
        --max-weight-bytes-per-rank 24e9                        # the same under a 24 GB card's budget

Model: Llama-3-8B's shape with SmolLM2's vocabulary and tokenizer, random bf16 weights (as
scripts/bench_fleet_gpu.py builds it); with --model-kind qwen14b, Qwen-14B-Chat's shape as a
QWenLMHeadModel folder with random bf16 weights and a synthetic qwen.tiktoken of the real size
(testkit/qwen_checkpoints.py; the bench's words are a token each, so the prompts are as long in
tokens as with the real vocabulary). Workload, at each --rates for --seconds of Poisson arrivals
(`tokenfleet bench`'s plan, seed 0): chats with one shared system prompt of --prefix-tokens (about
800 tokens, prefix-cached after the first), a user turn of 40-300 words, 16-512 output tokens
(lognormal, mean 150), greedy, EOS ignored.

(a) the fleet: `tokenfleet up --model M --port P` (Redis, the scheduler, the gateway with its
    default workers), and `tokenfleet bench` streaming /v1/chat/completions from this process;
    TTFT from each request's POST, ITL between its content chunks.
(b) the engine: LLMEngine with the config `tokenfleet scheduler --model M` builds on this device
    (its tokenizer loaded, as the scheduler's), in this process, after the fleet is stopped; each
    planned chat rendered by the gateway's own chat-template code, and added when its arrival
    time comes; TTFT from that scheduled time, ITL between the steps that gave it tokens.

--py-spy DIR records the scheduler (and its publisher) and the gateway (and its workers) for
--seconds during the --py-spy-rate run (`python -m testkit.spy_summary` sums it up).
--engine-ab runs no fleet: the engine twice, with mixed-step CUDA graphs and
with every mixed step eager (cuda_graph_max_tokens 0), reporting the host time of a mixed
step's forward and the engine thread's share of time waiting on the GPU. --engine-ab async
compares async scheduling on and off the same way (both with the graphs). Prints the command
line first and the table last.

    python3 scripts/bench_serve_gpu.py --tokenizer DIR --engine-ab async   # one H200, ~4 min
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import psutil
import redis
import torch
from bench_fleet_gpu import prepare_model

from gateway.models import ServedModel
from protocol.keys import Keys
from protocol.result_record import F
from shared.gc_tuning import tune_for_serving
from shared.net import free_port
from testkit import py_spy
from testkit.arrivals import Chats, ServingRow, run_chats
from testkit.processes import Children, wait_ready
from testkit.result_wait import ResultWaitProbe
from testkit.runs import log, percentile, print_command, raise_fd_limit
from tokenfleet import bench as fleet_bench
from tokenfleet.cli import build_parser
from tokenfleet.engine_flags import engine_config

MODEL_NAME = "bench-model"


def bench_args(args: argparse.Namespace, url: str, rate: float) -> argparse.Namespace:
    """`tokenfleet bench`'s flags for one rate (the engine's plan is drawn from the same)."""
    return argparse.Namespace(
        url=url, model=MODEL_NAME, num_requests=1, duration=args.seconds, rate=rate, concurrency=100_000,
        client_processes=args.client_processes,
        prefix_tokens=args.prefix_tokens, prompt_words="40-300", max_tokens="16-512:lognormal:150",
        temperature=0.0, completions=False, api_key=None, seed=0, timeout_s=300.0,
        slo_ttft_ms=None, slo_itl_ms=None)


def fleet_rows(args: argparse.Namespace, folder: Path, rates: list[float], out: Path) -> dict[float, dict]:
    home = Path(tempfile.mkdtemp(prefix="tokenfleet-serve-home-"))
    os.environ["TOKENFLEET_HOME"] = str(home)
    children = Children(out)
    port = free_port()
    children.spawn("up", [sys.executable, "-m", "tokenfleet.cli", "up", "--model", str(folder),
                          "--model-name", MODEL_NAME, "--port", str(port), *quant_flags(args)])
    summaries: dict[float, dict] = {}
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, children, timeout_s=600)
        log("fleet ready")
        warm = bench_args(args, url, 4.0)
        warm.duration = 2.0
        asyncio.run(fleet_bench.run(warm))
        redis_url = redis_url_of(out / "up.log")
        for rate in rates:
            spies: list[subprocess.Popen] = []  # started with the load (not the clients' imports)
            started: list[float] = []

            def profile(rate=rate, spies=spies, started=started) -> None:
                started.append(time.monotonic())
                spies.extend(start_py_spy(args, rate, out))

            with ResultWaitProbe(redis_url) as probe:
                results, wall, model = asyncio.run(fleet_bench.run(bench_args(args, url, rate),
                                                                   on_start=profile))
            # The wait's share while requests arrive (the first second is the ramp).
            gpu_wait = probe.share(started[0] + 1.0, started[0] + args.seconds) if started else None
            summaries[rate] = {"results": results, "wall": wall, "gpu_wait": gpu_wait,
                               "ttft_parts": ttft_parts(redis_url, results)}
            for spy in spies:
                spy.wait(timeout=args.seconds + 60)
            ok = [r for r in results if r.ok]
            # Percentiles too, as each engine row logs its own: a run cut short keeps them.
            ttft = [r.first_token - r.started for r in ok if r.first_token is not None]
            itl = [gap for r in ok for gap in r.gaps]
            log(f"fleet {rate:g} req/s: {len(ok)}/{len(results)} ok, "
                f"{sum(r.output_tokens for r in ok) / wall:,.0f} tok/s, TTFT p50 / p99 "
                f"{_ms(ttft, 50)} / {_ms(ttft, 99)} ms, ITL p99 {_ms(itl, 99)} ms, "
                f"engine thread waiting on the GPU {_share(gpu_wait)}")
    finally:
        children.stop()
        shutil.rmtree(home, ignore_errors=True)
    return summaries


def _share(value: float | None) -> str:
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


def ttft_parts(redis_url: str, results: list) -> dict[str, list[float]]:
    """Each streamed request's TTFT cut at its record's timestamps (seconds): the gateway (POST
    to queued_at), the queue (to started_at: a scheduler claimed it), the engine (to
    first_token_at: the step that made it was handed to the publisher), and the delivery
    (publisher, Redis, gateway, SSE: to the client's first content chunk)."""
    ok = [r for r in results if r.ok and r.req_id]
    client = redis.Redis.from_url(redis_url)
    pipe = client.pipeline(transaction=False)
    for r in ok:
        pipe.hmget(Keys().result(r.req_id), [F.QUEUED_AT, F.STARTED_AT, F.FIRST_TOKEN_AT])
    parts: dict[str, list[float]] = {name: [] for name in TTFT_PARTS}
    for r, row in zip(ok, pipe.execute(), strict=True):
        if None in row:
            continue
        queued, started, first = (float(v) for v in row)
        for name, value in zip(TTFT_PARTS, (queued - r.started_wall, started - queued, first - started,
                                            r.first_token_wall - first), strict=True):
            parts[name].append(value)
    client.close()
    return parts


def start_py_spy(args: argparse.Namespace, rate: float, out: Path) -> list[subprocess.Popen]:
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
        spies.append(py_spy.record(process.pid, args.seconds, args.py_spy / f"serve{rate:g}_{role}.txt",
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
        tune_for_serving()  # as the fleet's scheduler runs (shared/gc_tuning.py)
        for rate in rates:
            planned = fleet_bench.plan_requests(bench_args(args, "", rate), MODEL_NAME)
            chats = Chats([p.arrival for p in planned],
                          [served.encode_chat(p.body["messages"])[1] for p in planned],
                          [p.body["max_tokens"] for p in planned])
            rows[rate] = run_chats(engine, chats, f"engine {rate:g} req/s")
            log(str(rows[rate]))
    return rows


def print_engine_ab(description: str, rates: list[float], runs: dict[str, dict[float, ServingRow]]) -> None:
    print(f"\n{description}; the engine alone: {' against '.join(runs)}\n")
    print("| run | output tok/s | TTFT p50 | TTFT p99 | ITL p99 | host ms per mixed forward "
          "| mixed steps (in graphs) | waiting on the GPU |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mode, rows in runs.items():
        for rate in rates:
            r = rows[rate]
            print(f"| {mode}, {rate:g} req/s | {r.tok_s:,.0f} | {1e3 * r.ttft_p50:.0f} ms "
                  f"| {1e3 * r.ttft_p99:.0f} ms | {1e3 * r.itl_p99:.0f} ms | {r.mixed_ms:.2f} "
                  f"| {r.mixed_steps} ({r.graph_steps}) | {r.gpu_wait:.0%} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on this CPU, low rates")
    parser.add_argument("--tokenizer",
                        help="folder with SmolLM2's tokenizer files (default: the default model's)")
    parser.add_argument("--rates", default="16,32,48,64")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--prefix-tokens", type=int, default=800)
    parser.add_argument("--py-spy", type=Path, help="folder for the scheduler's py-spy profile")
    parser.add_argument("--py-spy-rate", type=float, default=48.0)
    parser.add_argument("--py-spy-blocking", action="store_true",
                        help="pause the process per sample: none torn, but the GPU wait it shows shrinks "
                             "(testkit/py_spy.py)")
    parser.add_argument("--client-processes", type=int, default=4,
                        help="client processes the streams are dealt over (one adds its own queueing)")
    parser.add_argument("--logs", type=Path, help="folder for the fleet's logs (default: a temp folder)")
    parser.add_argument("--quantization", choices=("fp8",), help="fp8 weights (fleet and engine alike)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    parser.add_argument("--model-kind", default="llama8b", choices=("llama8b", "qwen14b"),
                        help="llama8b: Llama-3-8B's shape with SmolLM2's tokenizer; qwen14b: Qwen-14B-Chat's "
                             "shape as a QWenLMHeadModel folder (testkit/qwen_checkpoints.py)")
    parser.add_argument("--max-weight-bytes-per-rank", help="e.g. 24e9: the 24 GB card's budget, refused "
                                                            "when one rank's weights need more")
    parser.add_argument("--engine-ab", nargs="?", const="graphs", choices=tuple(AB_RUNS),
                        help="no fleet: the engine with mixed-step graphs against every mixed step eager "
                             "(graphs, the default), or with async scheduling on against off (async)")
    args = parser.parse_args(argv)
    print_command()
    rates = [float(r) for r in args.rates.split(",")]
    if args.smoke:
        args.device, args.seconds, args.prefix_tokens = "cpu", min(args.seconds, 4.0), 100
        rates = [1.0, 2.0]
    raise_fd_limit(4096)
    folder = Path(tempfile.mkdtemp(prefix="tokenfleet-serve-model-"))
    out = args.logs or Path(tempfile.mkdtemp(prefix="tokenfleet-serve-logs-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        description = write_model(args, folder)
        if args.engine_ab:
            runs = {label: engine_rows(args, folder, rates, flags=tuple(flags))
                    for label, flags in AB_RUNS[args.engine_ab].items()}
            print_engine_ab(description, rates, runs)
            return
        fleet = fleet_rows(args, folder, rates, out)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        engine = engine_rows(args, folder, rates)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"\n{description}; {args.seconds:g} s of Poisson arrivals per rate; shared prefix "
          f"{args.prefix_tokens} words; weights {args.quantization or 'as stored'}, KV cache "
          f"{args.kv_cache_dtype}\n")
    print("| req/s | fleet tok/s | engine tok/s | fleet / engine | TTFT p50 fleet / engine "
          "| TTFT p99 fleet / engine | ITL p99 fleet / engine "
          "| engine thread waiting on the GPU, fleet / engine | failed |")
    print("| ---: | ---: | ---: | ---: | --- | --- | --- | --- | ---: |")
    for rate in rates:
        results = fleet[rate]["results"]
        ok = [r for r in results if r.ok]
        last = max((r.finished for r in ok), default=0.0)
        first = min((r.started for r in results), default=0.0)
        tok_s = sum(r.output_tokens for r in ok) / max(1e-9, last - first)
        ttft = [r.first_token - r.started for r in ok]
        itl = [g for r in ok for g in r.gaps]
        e = engine[rate]
        print(f"| {rate:g} | {tok_s:,.0f} | {e.tok_s:,.0f} | {tok_s / e.tok_s:.2f} "
              f"| {1e3 * percentile(ttft, 50):.0f} / {1e3 * e.ttft_p50:.0f} ms "
              f"| {1e3 * percentile(ttft, 99):.0f} / {1e3 * e.ttft_p99:.0f} ms "
              f"| {1e3 * percentile(itl, 99):.0f} / {1e3 * e.itl_p99:.0f} ms "
              f"| {_share(fleet[rate]['gpu_wait'])} / {e.gpu_wait:.0%} | {len(results) - len(ok)} |")
    print("\nThe fleet's TTFT in parts, p50 / p99 ms (from each request's tf:res timestamps):\n")
    print("| req/s | " + " | ".join(TTFT_PARTS) + " |")
    print("| ---: |" + " --- |" * len(TTFT_PARTS))
    for rate in rates:
        parts = fleet[rate]["ttft_parts"]
        print(f"| {rate:g} | " + " | ".join(
            f"{1e3 * percentile(parts[name], 50):.1f} / {1e3 * percentile(parts[name], 99):.1f}"
            if parts[name] else "-" for name in TTFT_PARTS) + " |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
