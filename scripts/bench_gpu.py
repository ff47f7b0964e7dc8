"""GPU throughput (issue 8): tokenfleet's engine against transformers on one GPU, in one run.

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
import gc
import math
import os
import random
import shlex
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler.engine import LLMEngine  # noqa: E402
from shared.config import EngineConfig  # noqa: E402
from shared.logging import configure_logging  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                 max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY_LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512, rope_theta=500000.0, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)
INIT_STD = 0.02
T0 = time.perf_counter()


class Interrupted(BaseException):
    """SIGTERM (e.g. from `timeout`): stop measuring, print the table so far."""


def stop_on_sigterm() -> None:
    def handler(signum, frame):
        raise Interrupted()

    signal.signal(signal.SIGTERM, handler)


def log(message: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {message}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- workload ---------------------------------------------------------------------------


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    def head(self, n: int) -> Workload:
        return Workload(self.prompts[:n], self.max_tokens[:n])


def lognormal_length(rng: random.Random, mean: float, sigma: float, low: int, high: int) -> int:
    # A lognormal of mean m has mu = ln m - sigma^2 / 2.
    return min(high, max(low, round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma))))


def make_workload(num_requests: int, vocab_size: int, *, prompt_max: int = 1024, output_max: int = 512,
                  seed: int = 0) -> Workload:
    """ShareGPT-like lengths (issue 8): per request its prompt, then its output length."""
    rng = random.Random(seed)
    prompts, max_tokens = [], []
    for _ in range(num_requests):
        num_prompt = lognormal_length(rng, 200, 0.9, 8, prompt_max)
        prompts.append([rng.randrange(vocab_size) for _ in range(num_prompt)])
        max_tokens.append(lognormal_length(rng, 180, 0.8, 8, output_max))
    return Workload(prompts, max_tokens)


# -- the hardware ---------------------------------------------------------------------------


def time_repeated(fn, device: torch.device, repeats: int) -> float:
    """Seconds per call of fn, after a warm-up."""
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeats


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = time_repeated(lambda: dst.copy_(src), device, 10)
    return 2 * num_bytes / seconds


def matmul_rate(device: torch.device, size: int) -> float:
    """FLOP/s of a bf16 size^3 matrix product on random data."""
    a = torch.randn(size, size, device=device).to(torch.bfloat16)
    b = torch.randn(size, size, device=device).to(torch.bfloat16)
    seconds = time_repeated(lambda: a @ b, device, 10)
    return 2 * size**3 / seconds


@dataclass
class Roofline:
    compute_s: float
    weight_stream_s: float
    kv_read_s: float
    notes: str

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.weight_stream_s + self.kv_read_s)


def roofline(num_params: int, weight_bytes: int, kv_bytes_per_token: int, workload: Workload,
             max_num_seqs: int, flops: float, bandwidth: float) -> Roofline:
    num_tokens = workload.num_prompt_tokens + workload.num_output_tokens
    compute_s = 2 * num_params * num_tokens / flops
    min_steps = max(max(workload.max_tokens), -(-workload.num_output_tokens // max_num_seqs))
    weight_stream_s = min_steps * weight_bytes / bandwidth
    # Output token j of a request reads the K/V of its prompt and of its j earlier outputs.
    pairs = zip(workload.prompts, workload.max_tokens, strict=True)
    cached = sum(m * len(p) + m * (m - 1) // 2 for p, m in pairs)
    kv_read_s = cached * kv_bytes_per_token / bandwidth
    notes = (f"compute floor {compute_s:.2f} s (2 x {num_params / 1e9:.2f} B params x {num_tokens:,} tokens "
             f"at {flops / 1e12:,.0f} TFLOP/s); memory floor {weight_stream_s + kv_read_s:.2f} s "
             f"({min_steps} steps x {weight_bytes / 1e9:.1f} GB of weights + "
             f"{cached * kv_bytes_per_token / 1e9:.0f} GB of K/V reads at {bandwidth / 1e9:,.0f} GB/s)")
    return Roofline(compute_s, weight_stream_s, kv_read_s, notes)


# -- the checkpoint ----------------------------------------------------------------------------


def build_model(shape: dict, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A transformers Llama with random bf16 weights, built on the device."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**shape, initializer_range=INIT_STD)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():  # explicit, whatever from_config initialised
            if param.dim() == 1:
                param.fill_(1.0)  # RMSNorm weights
            else:
                param.normal_(0.0, INIT_STD, generator=generator)
    return model.eval()


def checkpoint_folder(num_bytes: int) -> Path:
    """A fresh folder in /dev/shm when it has room (loads at memory speed), else in the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 1.3 * num_bytes:
        return Path(tempfile.mkdtemp(prefix="tokenfleet-bench-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="tokenfleet-bench-"))


def count_params(shape: dict) -> int:
    """Parameters of a Llama of this shape (untied embeddings), without building it."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = hidden // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden
    return 2 * shape["vocab_size"] * hidden + shape["num_hidden_layers"] * per_layer + hidden


def weight_bytes_of(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# -- the table ---------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    output_rate: float | None = None  # tokens/s
    total_rate: float | None = None
    seconds: float | None = None
    of_roofline: str = "-"
    notes: str = ""


def failed_row(name: str, exc: BaseException) -> Row:
    traceback.print_exc()
    first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
    return Row(name, notes=f"FAILED: {type(exc).__name__}: {first_line}")


def print_table(rows: list[Row], caption: str) -> None:
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    print(f"\n{caption}\n")
    print("| measurement | output tok/s | total tok/s | seconds | of roofline | notes |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r.name} | {num(r.output_rate, ',.0f')} | {num(r.total_rate, ',.0f')} | "
              f"{num(r.seconds, '.1f')} | {r.of_roofline} | {r.notes} |")


# -- (a) tokenfleet -------------------------------------------------------------------------


@dataclass
class EngineRun:
    row: Row
    output_rate: float = 0.0
    latency_ms: float | None = None
    extra: dict = field(default_factory=dict)


def run_engine_workload(engine: LLMEngine, workload: Workload, seconds_limit: float,
                        device: torch.device) -> Row:
    """All requests at once; stepped until done or until the time limit (then partial)."""
    runner = getattr(engine.executor, "runner", None)
    counts = {"steps": 0, "graph_steps": 0, "execute_s": 0.0}
    execute = engine.executor.execute

    def timed_execute(batch):
        start = time.perf_counter()
        try:
            return execute(batch)
        finally:
            counts["steps"] += 1
            counts["execute_s"] += time.perf_counter() - start

    engine.executor.execute = timed_execute
    graphs = getattr(runner, "decode_graphs", None)
    if graphs is not None:
        graph_run = graphs.run

        def counted_run(works):
            counts["graph_steps"] += 1
            return graph_run(works)

        graphs.run = counted_run
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in workload.max_tokens]
    prompt_len: dict[str, int] = {}
    sync(device)
    start = time.perf_counter()
    for prompt, sp in zip(workload.prompts, params, strict=True):
        prompt_len[engine.add_request(prompt, sp)] = len(prompt)
    num_output, started, partial = 0, set(), False
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_output += len(out.new_token_ids)
            started.add(out.req_id)
        if time.perf_counter() - start > seconds_limit:
            partial = True
            break
    elapsed = time.perf_counter() - start
    engine.executor.execute = execute
    if graphs is not None:
        graphs.run = graph_run
    if partial:
        for req_id in prompt_len:
            engine.abort(req_id)
        while engine.has_unfinished_requests():
            engine.step()
    elif num_output != workload.num_output_tokens:
        raise RuntimeError(f"the engine made {num_output} tokens, not {workload.num_output_tokens}")
    num_total = num_output + sum(prompt_len[r] for r in started)
    replays = f" ({counts['graph_steps']} CUDA-graph decodes)" if graphs is not None else ""
    notes = (f"{len(workload.prompts)} requests; {counts['steps']} steps{replays}; "
             f"{counts['execute_s'] / elapsed:.0%} of the time in the workers' execute")
    if partial:
        notes += f"; PARTIAL: stopped at the {seconds_limit:.0f} s limit, {len(started)} requests started"
    return Row("(a) tokenfleet engine", num_output / elapsed, num_total / elapsed, elapsed, notes=notes)


def engine_decode_latency(engine: LLMEngine, vocab_size: int, device: torch.device,
                          num_prompt: int = 128, num_output: int = 128) -> float:
    """Seconds per output token of one request alone, its prefill step left out (best of 2)."""
    rng = random.Random(1)
    best = float("inf")
    for _ in range(2):
        prompt = [rng.randrange(vocab_size) for _ in range(num_prompt)]
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=num_output, ignore_eos=True))
        engine.step()  # the prefill and the first token
        sync(device)
        start, count = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            count += sum(len(out.new_token_ids) for out in engine.step())
        best = min(best, (time.perf_counter() - start) / max(count, 1))
    return best


def warm_up(engine: LLMEngine, vocab_size: int) -> None:
    """First-call costs (kernel compiles, cuBLAS plans, prefill attention) are not throughput."""
    rng = random.Random(2)
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in (8, 100, 600, 17)]
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))


# -- (b), (c) transformers -----------------------------------------------------------------


def hf_generate(model, prompts: list[list[int]], num_new: int, device: torch.device) -> None:
    """One static, left-padded batch making exactly num_new tokens per row."""
    width = max(map(len, prompts))
    input_ids = torch.zeros((len(prompts), width), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                             do_sample=False, max_new_tokens=num_new, min_new_tokens=num_new,
                             eos_token_id=None, pad_token_id=0)
    if out.shape[1] - width != num_new:
        raise RuntimeError(f"transformers made {out.shape[1] - width} tokens, not {num_new}")


def run_hf_static(model, workload: Workload, batch_size: int, seconds_limit: float,
                  device: torch.device) -> Row:
    hf_generate(model, [workload.prompts[0][:16]], 4, device)  # warm-up
    batches = [range(i, min(i + batch_size, len(workload.prompts)))
               for i in range(0, len(workload.prompts), batch_size)]
    elapsed, done, last, num_batches = 0.0, [], 0.0, 0
    for indices in batches:
        if done and elapsed + last > seconds_limit:  # this batch would end past the limit
            break
        sync(device)
        start = time.perf_counter()
        hf_generate(model, [workload.prompts[i] for i in indices],
                    max(workload.max_tokens[i] for i in indices), device)
        sync(device)
        last = time.perf_counter() - start
        elapsed += last
        done.extend(indices)
        num_batches += 1
    num_output = sum(workload.max_tokens[i] for i in done)
    num_total = num_output + sum(len(workload.prompts[i]) for i in done)
    notes = (f"{num_batches} of {len(batches)} batches of {batch_size} "
             f"({len(done)} requests) within the {seconds_limit:.0f} s bound; useful tokens only")
    return Row("(b) transformers generate, static batches", num_output / elapsed, num_total / elapsed,
               elapsed, notes=notes)


def hf_decode_latency(model, vocab_size: int, device: torch.device, num_prompt: int = 128,
                      num_output: int = 32) -> float:
    rng = random.Random(1)
    prompt = [rng.randrange(vocab_size) for _ in range(num_prompt)]
    hf_generate(model, [prompt], 4, device)  # warm-up
    sync(device)
    start = time.perf_counter()
    hf_generate(model, [prompt], num_output, device)
    sync(device)
    return (time.perf_counter() - start) / num_output


def run_hf_continuous(model, workload: Workload, seconds_limit: float, device: torch.device) -> Row:
    """transformers' continuous batching: every request at once, results until done or the limit."""
    import inspect

    from transformers import GenerationConfig

    generation_config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.max_tokens),
                                         pad_token_id=0)
    generation_config.eos_token_id = -1  # EOS off (set after construction: no validation of -1)
    cm_params = inspect.signature(model.continuous_batching_context_manager).parameters
    cm_kwargs = {"generation_config": generation_config, "block": True, "timeout": 30}
    if "warmup" in cm_params:
        cm_kwargs["warmup"] = True
    with model.continuous_batching_context_manager(**cm_kwargs) as manager:
        add_params = inspect.signature(manager.add_request).parameters
        eos = {"eos_token_id": -1} if "eos_token_id" in add_params else {}
        sync(device)
        start = time.perf_counter()
        wanted = {}
        for i, (prompt, num_new) in enumerate(zip(workload.prompts, workload.max_tokens, strict=True)):
            req_id = manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=num_new, **eos)
            wanted[req_id or f"r{i}"] = i
        num_output = num_prompt = finished = 0
        last = start
        while finished < len(wanted) and time.perf_counter() - start < seconds_limit:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("the continuous-batching loop died")
                continue
            if result.is_finished() and result.request_id in wanted:
                i = wanted[result.request_id]
                num_output += min(len(result.generated_tokens), workload.max_tokens[i])
                num_prompt += len(workload.prompts[i])
                finished += 1
                last = time.perf_counter()
        if finished < len(wanted) and "hard_stop" in inspect.signature(manager.stop).parameters:
            manager.stop(block=True, timeout=30, hard_stop=True)
    elapsed = last - start
    if not finished:
        raise RuntimeError(f"no request finished within {seconds_limit:.0f} s")
    notes = (f"{finished} of {len(wanted)} requests (the workload's first {len(wanted)}) finished "
             f"in {elapsed:.0f} s (bound {seconds_limit:.0f} s); rate over finished requests")
    return Row("(c) transformers continuous batching", num_output / elapsed,
               (num_output + num_prompt) / elapsed, elapsed, notes=notes)


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny model and workload (checks the script)")
    parser.add_argument("--num-requests", type=int, help="default 500 (24 with --smoke)")
    parser.add_argument("--max-num-seqs", type=lambda text: [int(v) for v in text.split(",")], default=[512],
                        help="cap on running sequences (and the largest CUDA graph); a comma list runs the "
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
    print("$", shlex.join(["python3", *sys.argv]), flush=True)
    configure_logging("WARNING")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available here; use --device cpu --smoke to check the script")
    import transformers

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, {where}")
    shape = TINY_LLAMA if args.smoke else LLAMA3_8B
    num_requests = args.num_requests or (24 if args.smoke else 500)
    workload = make_workload(num_requests, shape["vocab_size"], prompt_max=200 if args.smoke else 1024,
                             output_max=48 if args.smoke else 512)
    log(f"workload: {num_requests} requests, {workload.num_prompt_tokens:,} prompt + "
        f"{workload.num_output_tokens:,} output tokens")
    rows: list[Row] = []
    bandwidth = copy_bandwidth(device, (256 << 20) if args.smoke else (4 << 30))
    flops = matmul_rate(device, 1024 if args.smoke else 8192)
    log(f"copy bandwidth {bandwidth / 1e9:,.0f} GB/s, bf16 matmul {flops / 1e12:,.1f} TFLOP/s")
    rows.append(Row("device copy bandwidth", notes=f"{bandwidth / 1e9:,.0f} GB/s (device-to-device copy of "
                    f"{'256 MB' if args.smoke else '4 GB'}, bytes read + written)"))
    rows.append(Row("device bf16 matmul", notes=f"{flops / 1e12:,.1f} TFLOP/s "
                    f"({'1024' if args.smoke else '8192'}^3, random data)"))
    stop_on_sigterm()
    try:
        run_all(args, shape, workload, device, bandwidth, flops, rows)
    except Interrupted:
        rows.append(Row("INTERRUPTED", notes=f"SIGTERM after {time.perf_counter() - T0:.0f} s: the rows "
                        "above are what finished"))
    except Exception as exc:  # noqa: BLE001 - whatever broke, the rows so far are printed
        rows.append(failed_row("building or saving the model", exc))
    num_params = count_params(shape)
    ours = next((r for r in rows if r.name.startswith("(a)") and r.output_rate), None)
    cb = next((r for r in rows if r.name.startswith("(c)") and r.output_rate), None)
    if ours and cb:
        ours.notes += f"; {ours.output_rate / cb.output_rate:.1f}x transformers' continuous batching"
    log("done")
    caption = (f"{where}, Llama-3-8B shape ({num_params / 1e9:.2f} B params, bf16), {num_requests} requests "
               f"({workload.num_prompt_tokens:,} prompt + {workload.num_output_tokens:,} output tokens)")
    print_table(rows, f"SMOKE RUN on {where}: tiny model, not a measurement" if args.smoke else caption)


def run_all(args, shape: dict, workload: Workload, device: torch.device, bandwidth: float, flops: float,
            rows: list[Row]) -> None:
    """Build and save the model, then measure every system; rows as they finish."""
    model = build_model(shape, device)
    num_params = sum(p.numel() for p in model.parameters())
    weight_bytes = weight_bytes_of(model)
    folder = checkpoint_folder(weight_bytes)
    try:
        model.save_pretrained(folder)
        log(f"model: {num_params / 1e9:.3f} B parameters, {weight_bytes / 1e9:.2f} GB, saved to {folder}")
        head_dim = shape["hidden_size"] // shape["num_attention_heads"]
        kv_bytes_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * 2
        roof = roofline(num_params, weight_bytes, kv_bytes_per_token, workload, args.max_num_seqs[0], flops,
                        bandwidth)
        roof_rate = workload.num_output_tokens / roof.seconds
        num_tokens = workload.num_prompt_tokens + workload.num_output_tokens
        rows.append(Row("roofline of this workload", roof_rate, num_tokens / roof.seconds, roof.seconds,
                        "100%", roof.notes))
        floor_s = weight_bytes / bandwidth
        rows.extend(run_ours(args, folder, workload, device, roof_rate, floor_s, shape["vocab_size"]))
        rows.extend(run_transformers(args, model, workload, device, roof_rate, floor_s, shape["vocab_size"]))
    finally:
        if not args.keep_checkpoint:
            shutil.rmtree(folder, ignore_errors=True)


def run_ours(args, folder: Path, workload: Workload, device: torch.device, roof_rate: float,
             floor_s: float, vocab_size: int) -> list[Row]:
    if args.skip_engine:
        return []
    rows = []
    for i, max_num_seqs in enumerate(args.max_num_seqs):
        rows += run_engine_config(args, max_num_seqs, folder, workload, device, roof_rate, floor_s,
                                  vocab_size, measure_latency=i == 0 and not args.skip_engine_latency)
    return rows


def run_engine_config(args, max_num_seqs: int, folder: Path, workload: Workload, device: torch.device,
                      roof_rate: float, floor_s: float, vocab_size: int, *,
                      measure_latency: bool) -> list[Row]:
    rows = []
    engine = None
    try:
        config = EngineConfig(model=str(folder), device=args.device, dtype="bfloat16",
                              max_num_seqs=max_num_seqs, cuda_graph_max_batch_size=max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              cuda_graphs=not args.no_cuda_graphs)
        engine = LLMEngine(config, load_tokenizer_files=False)
        graphs = getattr(engine.executor.runner, "decode_graphs", None)
        log(f"engine loaded (max_num_seqs {max_num_seqs}): {engine.executor.num_kv_blocks} KV blocks, CUDA "
            f"graphs {'up to batch ' + str(graphs.sizes[-1]) if graphs else 'off'}")
        warm_up(engine, vocab_size)
        row = run_engine_workload(engine, workload, args.engine_seconds, device)
        row.of_roofline = f"{row.output_rate / roof_rate:.1%}"
        if len(args.max_num_seqs) > 1:
            row.name += f", max_num_seqs {max_num_seqs}"
        row.notes = f"max_num_seqs {max_num_seqs}; " + row.notes
        rows.append(row)
        log(f"engine (max_num_seqs {max_num_seqs}): {row.output_rate:,.0f} output tok/s")
    except Exception as exc:  # noqa: BLE001 - a failed measurement is a row, not the end of the table
        rows.append(failed_row(f"(a) tokenfleet engine, max_num_seqs {max_num_seqs}", exc))
    if engine is not None and measure_latency:
        try:
            seconds = engine_decode_latency(engine, vocab_size, device)
            notes = (f"{seconds * 1e3:.2f} ms/token (128 prompt, 128 output tokens) vs bandwidth floor "
                     f"{floor_s * 1e3:.2f} ms: {seconds / floor_s:.2f}x the floor")
            rows.append(Row("(a) tokenfleet batch-1 decode", 1 / seconds,
                            of_roofline=f"{floor_s / seconds:.1%}", notes=notes))
            log(f"engine batch-1: {seconds * 1e3:.2f} ms/token")
        except Exception as exc:  # noqa: BLE001
            rows.append(failed_row("(a) tokenfleet batch-1 decode", exc))
    if engine is not None:
        engine.close()
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def run_transformers(args, model, workload: Workload, device: torch.device, roof_rate: float,
                     floor_s: float, vocab_size: int) -> list[Row]:
    rows = []
    if not args.skip_hf_static:
        try:
            row = run_hf_static(model, workload, args.hf_batch_size, args.hf_static_seconds, device)
            row.of_roofline = f"{row.output_rate / roof_rate:.1%}"
            rows.append(row)
            log(f"transformers static: {row.output_rate:,.0f} output tok/s")
        except Exception as exc:  # noqa: BLE001
            rows.append(failed_row("(b) transformers generate, static batches", exc))
    if not args.skip_hf_latency:
        try:
            seconds = hf_decode_latency(model, vocab_size, device)
            notes = (f"{seconds * 1e3:.2f} ms/token (128 prompt, 32 output tokens): "
                     f"{seconds / floor_s:.1f}x the floor")
            rows.append(Row("(b) transformers batch-1 decode", 1 / seconds,
                            of_roofline=f"{floor_s / seconds:.1%}", notes=notes))
        except Exception as exc:  # noqa: BLE001
            rows.append(failed_row("(b) transformers batch-1 decode", exc))
    if not args.skip_hf_cb:
        try:
            row = run_hf_continuous(model, workload.head(args.hf_cb_requests), args.hf_cb_seconds, device)
            row.of_roofline = f"{row.output_rate / roof_rate:.1%}"
            rows.append(row)
            log(f"transformers continuous batching: {row.output_rate:,.0f} output tok/s")
        except Exception as exc:  # noqa: BLE001
            rows.append(failed_row("(c) transformers continuous batching", exc))
    return rows


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
