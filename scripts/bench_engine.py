"""Offline throughput: tokenfleet's engine against transformers `generate`, same run, same CPU.

    .venv/bin/python scripts/bench_engine.py                      # float32, 128 requests
    .venv/bin/python scripts/bench_engine.py --dtype bfloat16
    .venv/bin/python scripts/bench_engine.py --skip-hf            # iterate on our engine
    .venv/bin/python scripts/bench_engine.py --hf-subset 2        # baseline from 2 batches

Workload: `--num-requests` requests drawn with random.Random(0): prompts of 32-512 random
token ids (from [3, vocab), clear of the special ids), 16-256 output tokens each, EOS
ignored, greedy. Both systems must produce exactly each request's max_tokens; only those
"useful" output tokens count (transformers' padded batches make more, which it pays for).

Alongside: the CPU's matrix rate measured now, with the same threads, and the compute
floor of the workload at that rate, so each system's figure reads as a fraction of what
the hardware allows. Prints the command line first and a README-ready table last.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import shlex
import sys
import time
from dataclasses import dataclass

import torch

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.logging import configure_logging
from shared.sampling import SamplingParams
from workers.device import DTYPES
from workers.model_config import ModelConfig, load_model_config

FIRST_ORDINARY_TOKEN_ID = 3  # ids 0-2 are <|endoftext|>, <|im_start|>, <|im_end|> in SmolLM2
HF_BATCH_SIZE = 16
MATMUL_SIZE = 2048
MATMUL_SECONDS = 2.0  # how long to repeat the matmul for one rate
# Below this share of the cores, something else ran during the measurement: say so. Quiet
# runs get 99%; at 87% a run was seen 38% slower (threads wait on the one descheduled).
MIN_CPU_SHARE = 0.95


@dataclass
class Workload:
    prompts: list[list[int]]  # token ids of each request's prompt
    max_tokens: list[int]  # output tokens of each request

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    def batches(self, size: int) -> list[range]:
        return [range(i, min(i + size, len(self.prompts))) for i in range(0, len(self.prompts), size)]


class Stopwatch:
    """Wall time, and the share of `threads` cores this process got meanwhile.

    A share well below 1 means another process took the cores (this machine has two),
    and the figure is not the system's own.
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.seconds = 0.0
        self.cpu_seconds = 0.0

    def __enter__(self) -> Stopwatch:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds += time.perf_counter() - self._wall
        self.cpu_seconds += time.process_time() - self._cpu

    @property
    def cpu_share(self) -> float:
        return self.cpu_seconds / (self.seconds * self.threads) if self.seconds else 0.0


@dataclass
class Measurement:
    name: str
    seconds: float
    num_output_tokens: int  # useful ones only
    num_total_tokens: int  # useful output + prompt (no padding)
    cpu_share: float  # of the threads' cores, over the timed part
    note: str = ""

    @property
    def output_rate(self) -> float:
        return self.num_output_tokens / self.seconds

    @property
    def total_rate(self) -> float:
        return self.num_total_tokens / self.seconds


def make_workload(num_requests: int, vocab_size: int) -> Workload:
    rng = random.Random(0)
    prompts, max_tokens = [], []
    for _ in range(num_requests):
        num_prompt = rng.randint(32, 512)
        prompts.append([rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab_size) for _ in range(num_prompt)])
        max_tokens.append(rng.randint(16, 256))
    return Workload(prompts, max_tokens)


# -- the hardware -----------------------------------------------------------------


def matmul_rate(dtype: torch.dtype, size: int = MATMUL_SIZE, seconds: float = MATMUL_SECONDS) -> float:
    """FLOP/s of torch.matmul on size x size operands, after a warm-up."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    for _ in range(2):
        torch.matmul(a, b)
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or count < 3:
        torch.matmul(a, b)
        count += 1
    return 2 * size**3 * count / elapsed


def read_rate(num_bytes: int = 512 << 20, seconds: float = 1.0) -> float:
    """Bytes/s of reading a tensor far larger than the caches (torch.sum), after a warm-up."""
    x = torch.ones(num_bytes // 4)
    x.sum()
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or count < 3:
        x.sum()
        count += 1
    return num_bytes * count / elapsed


@dataclass
class ComputeFloor:
    num_body_params: int  # every layer's weights: run for every prompt and output token
    num_head_params: int  # the LM head: run only where a token is sampled
    linear_flops: float
    attention_flops: float

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops


def compute_floor(cfg: ModelConfig, workload: Workload) -> ComputeFloor:
    """FLOPs of the workload: 2 per weight per token, plus causal attention's QK^T and AV.

    The LM head counts only for output tokens (both systems compute logits only at the last
    position of a prompt); embeddings are lookups and norms are negligible.
    """
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = (
        cfg.hidden_size * (q_size + 2 * kv_size)  # qkv_proj
        + q_size * cfg.hidden_size  # o_proj
        + 3 * cfg.hidden_size * cfg.intermediate_size  # gate, up, down
    )
    body = cfg.num_layers * per_layer
    head = cfg.vocab_size * cfg.hidden_size
    num_tokens = workload.num_prompt_tokens + workload.num_output_tokens
    linear = 2.0 * body * num_tokens + 2.0 * head * workload.num_output_tokens
    # The token at position p attends to p + 1 keys: 2 FLOPs per (head, dim, key) for QK^T
    # and as many for AV. Summed over a sequence of n tokens: n (n + 1) / 2 keys.
    key_visits = sum(
        (n := len(p) + m) * (n + 1) // 2 for p, m in zip(workload.prompts, workload.max_tokens, strict=True)
    )
    attention = 4.0 * cfg.num_layers * q_size * key_visits
    return ComputeFloor(body, head, linear, attention)


def memory_floor_bytes(cfg: ModelConfig, floor: ComputeFloor, workload: Workload, dtype: str) -> float:
    """Bytes any engine must read: every weight once per step, and each decode's cached K/V.

    At least max(max_tokens) steps, as a sequence gains one token per step. After its prompt,
    the request's j-th new token attends to prompt + j cached tokens. Where this exceeds the
    compute floor, decoding is bound by memory bandwidth, not by the matrix rate.
    """
    elem = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    weight_bytes = (floor.num_body_params + floor.num_head_params) * elem
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
    cached_tokens_read = sum(
        m * len(p) + m * (m - 1) // 2 for p, m in zip(workload.prompts, workload.max_tokens, strict=True)
    )
    return weight_bytes * max(workload.max_tokens) + kv_bytes_per_token * cached_tokens_read


# -- the two systems --------------------------------------------------------------


def run_transformers(
    model_dir: str, dtype: torch.dtype, workload: Workload, num_batches: int | None
) -> Measurement:
    """Static padded batches of 16, left padding; only the first num_batches when given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    batches = workload.batches(HF_BATCH_SIZE)
    timed = batches if num_batches is None else batches[:num_batches]

    def generate(indices: range, stopwatch: Stopwatch) -> None:
        prompts = [workload.prompts[i] for i in indices]
        num_new = max(workload.max_tokens[i] for i in indices)
        width = max(map(len, prompts))
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        with stopwatch, torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                max_new_tokens=num_new, min_new_tokens=num_new, eos_token_id=None,
                pad_token_id=pad_id,
            )
        if out.shape[1] - width != num_new:
            raise RuntimeError(f"transformers made {out.shape[1] - width} tokens, not {num_new}")

    # Warm-up: first-call costs are not throughput.
    generate(range(1), Stopwatch(torch.get_num_threads()))
    stopwatch = Stopwatch(torch.get_num_threads())
    for indices in timed:
        generate(indices, stopwatch)
    seconds = stopwatch.seconds
    subset = [i for indices in timed for i in indices]
    measured = Measurement(
        "transformers generate", seconds,
        sum(workload.max_tokens[i] for i in subset),
        sum(workload.max_tokens[i] + len(workload.prompts[i]) for i in subset),
        stopwatch.cpu_share,
    )
    if len(timed) == len(batches):
        return measured
    # Scale the time by padded tokens (batch size x (longest prompt + most new tokens)),
    # which is what a static batch pays for; the rates of the subset would flatter or
    # punish it depending on how ragged its batches happen to be.
    def padded(indices: range) -> int:
        return len(indices) * (
            max(len(workload.prompts[i]) for i in indices) + max(workload.max_tokens[i] for i in indices)
        )

    scale = sum(map(padded, batches)) / sum(map(padded, timed))
    return Measurement(
        "transformers generate (extrapolated)", seconds * scale, workload.num_output_tokens,
        workload.num_prompt_tokens + workload.num_output_tokens, stopwatch.cpu_share,
        note=f"EXTRAPOLATED from {len(timed)} of {len(batches)} batches "
        f"({measured.seconds:.1f} s measured, x{scale:.2f} by padded tokens)",
    )


def run_engine(config: EngineConfig, workload: Workload) -> Measurement:
    engine = LLMEngine(config, load_tokenizer_files=False)
    engine.generate([workload.prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up

    # Count steps and preemptions without touching the engine: wrap its scheduler's call.
    counts = {"steps": 0, "preemptions": 0}
    schedule = engine.scheduler.schedule

    def counting_schedule():
        output = schedule()
        counts["steps"] += 1
        counts["preemptions"] += len(output.preempted_req_ids)
        return output

    engine.scheduler.schedule = counting_schedule
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in workload.max_tokens]
    with Stopwatch(config.num_threads or torch.get_num_threads()) as stopwatch:
        results = engine.generate(workload.prompts, params)
    num_kv_blocks = engine.executor.num_kv_blocks
    engine.close()
    for i, (result, expected) in enumerate(zip(results, workload.max_tokens, strict=True)):
        if len(result.token_ids) != expected:
            raise RuntimeError(f"request {i} got {len(result.token_ids)} tokens, not {expected}")
    return Measurement(
        "tokenfleet engine", stopwatch.seconds, workload.num_output_tokens,
        workload.num_prompt_tokens + workload.num_output_tokens, stopwatch.cpu_share,
        note=f"{counts['steps']} steps, {counts['preemptions']} preemptions, "
        f"{num_kv_blocks} KV blocks of {config.block_size} tokens",
    )


# -- the report -------------------------------------------------------------------


def print_table(
    floors: dict[str, float], workload: Workload, measurements: list[Measurement], caption: str
) -> None:
    """One row per floor (name -> seconds) and per system; fractions are of the compute floor."""
    floor_seconds = floors["compute floor"]
    num_total = workload.num_prompt_tokens + workload.num_output_tokens
    rows = [
        (name, seconds, workload.num_output_tokens / seconds, num_total / seconds, "",
         f"{floor_seconds / seconds:.3f}")
        for name, seconds in floors.items()
    ]
    baseline = next((m for m in measurements if m.name.startswith("transformers")), None)
    for m in measurements:
        ratio = f"{m.output_rate / baseline.output_rate:.2f}x" if baseline else "-"
        fraction = f"{floor_seconds / m.seconds:.3f}"
        rows.append((m.name, m.seconds, m.output_rate, m.total_rate, ratio, fraction))
    header = ("system", "wall s", "output tok/s", "total tok/s", "vs transformers", "of floor")
    print(f"\n{header[0]:<38} {header[1]:>8} {header[2]:>13} {header[3]:>12} {header[4]:>16} {header[5]:>9}")
    for name, seconds, out_rate, total_rate, ratio, fraction in rows:
        print(f"{name:<38} {seconds:>8.1f} {out_rate:>13.1f} {total_rate:>12.1f} {ratio:>16} {fraction:>9}")
    for m in measurements:
        print(f"  {m.name}: {m.note + '; ' if m.note else ''}got {m.cpu_share:.0%} of "
              f"{torch.get_num_threads()} cores")
        if m.cpu_share < MIN_CPU_SHARE:
            print(f"  WARNING: {m.name} got only {m.cpu_share:.0%} of the cores: another process "
                  "competed for them; re-run on a quiet machine before quoting this figure")

    disturbed = [m.name for m in measurements if m.cpu_share < MIN_CPU_SHARE]
    if disturbed:
        caption += f"; NOT QUOTABLE: {', '.join(disturbed)} shared the cores"
    print(f"\nMarkdown ({caption}):\n")
    print("| system | wall s | useful output tok/s | total tok/s | vs transformers | of compute floor |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, seconds, out_rate, total_rate, ratio, fraction in rows:
        print(f"| {name} | {seconds:.1f} | {out_rate:.1f} | {total_rate:.1f} | {ratio or '-'} | {fraction} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--skip-hf", action="store_true", help="run only tokenfleet's engine")
    parser.add_argument("--hf-subset", type=int, metavar="N",
                        help="run transformers on the first N batches only and extrapolate")
    parser.add_argument("--max-num-seqs", type=int, help="engine's cap on running sequences")
    parser.add_argument("--max-num-batched-tokens", type=int, help="engine's per-step token budget")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging("WARNING")
    executable = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    print("$", shlex.join([executable, *sys.argv]))
    torch.set_num_threads(args.threads)
    if args.model is None:
        from workers.default_model import fetch_default_model

        args.model = str(fetch_default_model())
    cfg = load_model_config(args.model)
    workload = make_workload(args.num_requests, cfg.vocab_size)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} cpus; model {args.model}")
    print(f"workload: {args.num_requests} requests, {workload.num_prompt_tokens} prompt + "
          f"{workload.num_output_tokens} output tokens, greedy, EOS ignored, dtype {args.dtype}")

    rates_before = measure_rates(args.dtype, "before")
    floor = compute_floor(cfg, workload)
    floor_bytes = memory_floor_bytes(cfg, floor, workload, args.dtype)
    print(f"compute floor: {floor.num_body_params / 1e6:.1f} M layer + {floor.num_head_params / 1e6:.1f} M "
          f"head parameters; {floor.linear_flops / 1e12:.2f} TFLOP linear + "
          f"{floor.attention_flops / 1e12:.2f} TFLOP attention; memory floor: "
          f"{floor_bytes / 1e9:.0f} GB read")

    measurements = []
    dtype = DTYPES[args.dtype]
    if not args.skip_hf:
        print("running transformers ...", flush=True)
        measurements.append(run_transformers(args.model, dtype, workload, args.hf_subset))
        gc.collect()  # the transformers model goes before ours loads
    engine_config = EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads)
    if args.max_num_seqs is not None:
        engine_config.max_num_seqs = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        engine_config.max_num_batched_tokens = args.max_num_batched_tokens
    print(f"running tokenfleet (max_num_seqs={engine_config.max_num_seqs}, "
          f"max_num_batched_tokens={engine_config.max_num_batched_tokens}) ...", flush=True)
    measurements.append(run_engine(engine_config, workload))
    rates_after = measure_rates(args.dtype, "after")
    # The higher of the two is the least disturbed, and so the stricter floor.
    rate = max(rates_before[args.dtype], rates_after[args.dtype])
    bandwidth = max(rates_before["read"], rates_after["read"])
    floors = {"compute floor": floor.flops / rate, "memory floor": floor_bytes / bandwidth}
    caption = (f"{args.dtype}, {len(workload.prompts)} requests, {torch.get_num_threads()} threads, "
               f"matmul {rate / 1e9:,.0f} GFLOP/s, read {bandwidth / 1e9:.0f} GB/s")
    print_table(floors, workload, measurements, caption)


def measure_rates(dtype: str, when: str) -> dict[str, float]:
    """FLOP/s of float32 matmul (and of `dtype`'s), and memory read bytes/s ("read"); printed."""
    names = ["float32"] if dtype == "float32" else ["float32", dtype]
    rates = {name: matmul_rate(DTYPES[name]) for name in names}
    rates["read"] = read_rate()
    shown = ", ".join(f"{name} {rates[name] / 1e9:,.0f}" for name in names)
    print(f"{when}: matmul {MATMUL_SIZE}^3 {shown} GFLOP/s; memory read {rates['read'] / 1e9:.1f} GB/s",
          flush=True)
    return rates


if __name__ == "__main__":
    main()
