"""The two systems scripts/bench_engine.py times on the CPU, on one workload: tokenfleet's
engine (`run_engine`) and transformers `generate` in static padded batches
(`run_transformers`), each a Measurement of useful output tokens over wall time, with the
share of the cores the process got meanwhile (Stopwatch); the CPU's matmul and read rates
(`measure_rates`), measured before and after them."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from testkit.roofline import matmul_rate, read_bandwidth
from testkit.workloads import Workload, greedy
from workers.device import DTYPES

HF_BATCH_SIZE = 16
MATMUL_SIZE = 2048
MATMUL_SECONDS = 2.0  # how long to repeat the matmul for one rate


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
    params = [greedy(m) for m in workload.max_tokens]
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


def measure_rates(dtype: str, when: str) -> dict[str, float]:
    """FLOP/s of float32 matmul (and of `dtype`'s), and memory read bytes/s ("read"); printed."""
    cpu = torch.device("cpu")
    names = ["float32"] if dtype == "float32" else ["float32", dtype]
    rates = {name: matmul_rate(cpu, DTYPES[name], MATMUL_SIZE, MATMUL_SECONDS) for name in names}
    rates["read"] = read_bandwidth(cpu, 512 << 20)
    shown = ", ".join(f"{name} {rates[name] / 1e9:,.0f}" for name in names)
    print(f"{when}: matmul {MATMUL_SIZE}^3 {shown} GFLOP/s; memory read {rates['read'] / 1e9:.1f} GB/s",
          flush=True)
    return rates
