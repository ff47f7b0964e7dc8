"""GPU throughput: tokenfleet's engine against transformers on one GPU, in one run.

    python3 scripts/bench_gpu.py                        # H200: Llama-3-8B shape, 500 requests, ~6 min
    python3 scripts/bench_gpu.py --smoke --device cpu   # tiny model and workload: checks the script anywhere

Builds a Llama-3-8B-shaped model (8.03 B parameters) with random bf16 weights (normal, std
0.02; norms 1) with transformers on the device, saves it as safetensors and loads it with
tokenfleet's own loader. Workload, drawn with random.Random(0): 500 requests, each a prompt
of lognormal length (mean 200, sigma 0.9, clipped to 8..1024) of random token ids, then an
output length (mean 180, sigma 0.8, clipped to 8..512); greedy, EOS ignored, all submitted at
once. Measured in the same run:
- the device's copy bandwidth (device-to-device copy of a 4 GB tensor, bytes read + written)
  and bf16 matmul rate (8192^3), which give the roofline of the workload;
- (a) tokenfleet's engine: output and total tokens/s, and its batch-1 decode latency
  (128-token prompt, 128 output tokens) against the bandwidth floor (weight bytes / bandwidth);
- (b) transformers `generate` in static padded batches of 64, time-bounded (--hf-static-seconds):
  no batch starts that would end past the bound; the rate is over the batches that finished;
- (c) transformers' continuous batching (its continuous-batching manager), on the first
  --hf-cb-requests requests, stopped at --hf-cb-seconds; the rate is over finished requests.

Roofline (docs/perf-notes.md): compute floor = 2 x parameters x (prompt + output tokens) /
matmul rate; memory floor = the weights streamed once per decode step, for at least
max(longest output, output tokens / max_num_seqs) steps, plus every decode's read of its cached
K/V, at the copy bandwidth; the roofline is the larger of the two.

Prints the command line first and one markdown table last; a measurement that fails prints a
row saying so and never stops the others.
"""

from __future__ import annotations

import argparse
import os
import time

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import torch

from shared.logging import configure_logging
from testkit.gpu_throughput import Row, device_rows, failed_row, note_against_continuous_batching, run_all
from testkit.random_models import LLAMA3_8B, TINY_LLAMA
from testkit.roofline import ModelShape
from testkit.runs import T0, Interrupted, log, print_command, stop_on_sigterm
from testkit.workloads import sharegpt_workload

# -- the table ---------------------------------------------------------------------------------


def print_table(rows: list[Row], caption: str) -> None:
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    print(f"\n{caption}\n")
    print("| measurement | output tok/s | total tok/s | seconds | of roofline | notes |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r.name} | {num(r.output_rate, ',.0f')} | {num(r.total_rate, ',.0f')} | "
              f"{num(r.seconds, '.1f')} | {r.of_roofline} | {r.notes} |")


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny model and workload (checks the script)")
    parser.add_argument("--num-requests", type=int, help="default 500 (24 with --smoke)")
    parser.add_argument("--max-num-seqs", default=[512],
                        type=lambda text: [0 if v == "auto" else int(v) for v in text.split(",")],
                        help="cap on running sequences (and the largest CUDA graph); auto: what the commands "
                             "choose for this card and model (and their graph cap); a comma list runs the "
                             "engine once per value, on the same checkpoint")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run every engine step eagerly")
    parser.add_argument("--engine-seconds", type=float, default=240.0, help="time limit of the engine run")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--hf-static-seconds", type=float, default=90.0)
    parser.add_argument("--hf-cb-requests", type=int, default=300,
                        help="continuous batching runs the first N requests")
    parser.add_argument("--hf-cb-seconds", type=float, default=100.0)
    for name in ("engine", "engine-latency", "hf-static", "hf-latency", "hf-cb"):
        parser.add_argument(f"--skip-{name}", action="store_true")
    parser.add_argument("--keep-checkpoint", action="store_true", help="do not delete the saved model")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print_command()
    configure_logging("WARNING")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available here; use --device cpu --smoke to check the script")
    import transformers

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, {where}")
    shape = TINY_LLAMA if args.smoke else LLAMA3_8B
    num_requests = args.num_requests or (24 if args.smoke else 500)
    workload = sharegpt_workload(num_requests, shape["vocab_size"], prompt_max=200 if args.smoke else 1024,
                                 output_max=48 if args.smoke else 512)
    log(f"workload: {num_requests} requests, {workload.num_prompt_tokens:,} prompt + "
        f"{workload.num_output_tokens:,} output tokens")
    bandwidth, flops, rows = device_rows(device, args.smoke)
    stop_on_sigterm()
    try:
        run_all(args, shape, workload, device, bandwidth, flops, rows)
    except Interrupted:
        rows.append(Row("INTERRUPTED", notes=f"SIGTERM after {time.perf_counter() - T0:.0f} s: the rows "
                        "above are what finished"))
    except Exception as exc:  # noqa: BLE001 - whatever broke, the rows so far are printed
        rows.append(failed_row("building or saving the model", exc))
    num_params = ModelShape.of(shape).num_params
    note_against_continuous_batching(rows)
    log("done")
    caption = (f"{where}, Llama-3-8B shape ({num_params / 1e9:.2f} B params, bf16), {num_requests} requests "
               f"({workload.num_prompt_tokens:,} prompt + {workload.num_output_tokens:,} output tokens)")
    print_table(rows, f"SMOKE RUN on {where}: tiny model, not a measurement" if args.smoke else caption)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
