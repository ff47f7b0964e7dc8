"""Serving under steady arrivals: the fleet (`tokenfleet up`, no other flags) against the in-process
engine fed the same arrivals, at several rates, in one run (the serving table of docs/perf-notes.md).

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
import shutil
import sys
import tempfile
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import torch

from testkit.arrivals import ServingRow
from testkit.json_share import RunFigures, json_share_table
from testkit.runs import percentile, print_command, raise_fd_limit
from testkit.serve_runs import (
    AB_RUNS,
    MODEL_NAME,
    TTFT_PARTS,
    bench_args,
    engine_rows,
    fleet_rows,
    share_text,
    write_model,
)
from tokenfleet import bench as fleet_bench


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


def print_json_share(args: argparse.Namespace, description: str, rates: list[float], fleet: dict) -> None:
    rows = {}
    for rate in rates:
        planned = fleet_bench.plan_requests(bench_args(args, "", rate, args.json_share), MODEL_NAME)
        is_json = {i for i, p in enumerate(planned) if "response_format" in p.body}
        rows[rate] = (RunFigures.of(fleet[rate, 0.0]["results"], set()),
                      RunFigures.of(fleet[rate, args.json_share]["results"], is_json))
    print(f"\n{description}; the fleet, {args.seconds:g} s of Poisson arrivals per rate, plain and with "
          f"{args.json_share:.0%} of the chats under a JSON schema (one long string)\n")
    print(json_share_table(args.json_share, rows))
    sys.stdout.flush()


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
    parser.add_argument("--json-share", type=float, default=0.0,
                        help="no engine rows: the fleet at each rate plain, then with this share of the "
                             "chats under a JSON schema (tokenfleet bench --json-share), and the ratios")
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
        if args.json_share:
            fleet = fleet_rows(args, folder, rates, out, shares=(0.0, args.json_share))
            print_json_share(args, description, rates, fleet)
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
        results = fleet[rate, 0.0]["results"]
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
              f"| {share_text(fleet[rate, 0.0]['gpu_wait'])} / {e.gpu_wait:.0%} | {len(results) - len(ok)} |")
    print("\nThe fleet's TTFT in parts, p50 / p99 ms (from each request's tf:res timestamps):\n")
    print("| req/s | " + " | ".join(TTFT_PARTS) + " |")
    print("| ---: |" + " --- |" * len(TTFT_PARTS))
    for rate in rates:
        parts = fleet[rate, 0.0]["ttft_parts"]
        print(f"| {rate:g} | " + " | ".join(
            f"{1e3 * percentile(parts[name], 50):.1f} / {1e3 * percentile(parts[name], 99):.1f}"
            if parts[name] else "-" for name in TTFT_PARTS) + " |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
