"""What grammar-constrained decoding costs: decode steps with and without a JSON schema, the
grammar work left on the step's critical path, a large mixed batch, and a whole workload's
throughput, each against unconstrained decoding of the same requests in the same run.

    python scripts/bench_structured.py --device cuda --tokenizer DIR   # H200: Llama-3-8B shape, bf16
    .venv/bin/python scripts/bench_structured.py --smoke # CPU: a tiny random llama, small sizes

Decode-step passes (prompts of random ids, temperature 1 with a seed each, EOS ignored where no
grammar ends them; timed: decode steps with every row present and past its prompt):
  (a) --batch rows unconstrained;  (b) the same rows, every one under one JSON schema whose answer
  cannot end within the run (a long free string first), so every matcher works every step;
  (c) as (b) with the grammar's parts timed: the bitmask fill (on the host, while the forward
  runs; "hidden" counts the steps where the device was still busy when the fill ended), the mask
  applied to the logits (synchronised to time it), the matchers accepting the tokens;
  (d) --mixed-batch rows unconstrained;  (e) the same with a quarter of them constrained.
Throughput: --requests requests (prompts of random length, --output-len tokens each) run to the
end through `generate`, unconstrained, then every one under the schema. Fill threads: the fill of
64 to 512 rows on 1..16 threads (xgrammar's batch matcher), matchers advanced by random tokens.
Async scheduling: --async-scheduling on|off (default: the device's, on for CUDA), so that the
throughput rows are the fully constrained 500-request burst against the unconstrained one with
it on. Prints the command first and the tables last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import torch

from scheduler.engine import LLMEngine
from scheduler.grammar import Grammars, available_cores
from shared.config import EngineConfig
from shared.logging import configure_logging
from shared.sampling import SamplingParams
from testkit.checkpoints import SMOLLM2_VOCAB_SIZE, tiny_llama_with_smollm2_tokenizer
from testkit.grammar_probes import Probes, probed
from testkit.random_models import checkpoint_folder, write_llama3_8b_with_smollm2_tokenizer
from testkit.roofline import sync
from testkit.runs import print_command

# An answer that cannot end within the run: its "body" string must run to thousands of characters.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "body": {"type": "string", "minLength": 4096},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "body", "tags"],
    "additionalProperties": False,
}
GRAMMAR = json.dumps({"type": "json_schema", "schema": SCHEMA})
FILL_ROWS = (64, 256, 512)  # --smoke: the first two, a quarter of them
FILL_THREADS = (1, 2, 4, 8, 16)


@dataclass
class Pass:
    name: str
    step_s: list[float] = field(default_factory=list)  # timed decode steps

    @property
    def mean_ms(self) -> float:
        return sum(self.step_s) / len(self.step_s) * 1e3


def decode_pass(engine: LLMEngine, name: str, prompts: list[list[int]], grammars: list[str | None],
                num_steps: int, device: torch.device, probes: Probes | None = None) -> Pass:
    result = Pass(name)
    req_ids = [engine.add_request(ids, SamplingParams(temperature=1.0, seed=i, max_tokens=num_steps + 8,
                                                      ignore_eos=True, grammar=grammar))
               for i, (ids, grammar) in enumerate(zip(prompts, grammars, strict=True))]
    requests = [engine.scheduler.get_request(r) for r in req_ids]
    timing = [False]
    context = probed(engine, device, probes, timing) if probes is not None else contextlib.nullcontext()
    with context:
        while engine.has_unfinished_requests():
            is_full = engine.scheduler.num_running_requests == len(prompts)
            timing[0] = (len(result.step_s) < num_steps and is_full
                         and all(r.num_computed_tokens >= r.num_prompt_tokens for r in requests))
            sync(device)
            start = time.perf_counter()
            engine.step()
            sync(device)
            if timing[0]:
                result.step_s.append(time.perf_counter() - start)
            elif len(result.step_s) >= num_steps:
                for req_id in req_ids:
                    engine.abort(req_id)
    if len(result.step_s) < num_steps // 2:
        raise RuntimeError(f"{name}: only {len(result.step_s)} full decode steps (a grammar ended early?)")
    return result


def throughput(engine: LLMEngine, prompts: list[list[int]], output_len: int, grammar: str | None) -> float:
    """Output tokens per second of the whole workload, run to the end."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=output_len, ignore_eos=True, grammar=grammar)
              for i in range(len(prompts))]
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / elapsed


def fill_scaling(engine: LLMEngine, rng: random.Random, fill_rows: tuple[int, ...],
                 fill_threads: tuple[int, ...]) -> dict[tuple[int, int], float]:
    """(rows, threads) -> ms per fill, matchers advanced by random allowed tokens (a random model
    under the mask writes such answers)."""
    vocab = engine.model_config.vocab_size
    grammars = Grammars(engine.tokenizer, vocab, sorted(engine.eos_token_ids))
    works = []
    for i in range(max(fill_rows)):
        grammars.add(f"f{i}", GRAMMAR, [])
        works.append(_fake_work(f"f{i}"))
    for _ in range(16):  # walk every matcher into its own state
        mask = grammars.fill(works)
        for row, work in zip(mask.rows, works, strict=True):
            allowed = _allowed(mask.bits[row], vocab)
            grammars.accept(work.req_id, allowed[rng.randrange(len(allowed))])
    times = {}
    for rows in fill_rows:
        for threads in fill_threads:
            grammars.num_fill_threads = threads
            grammars.fill(works[:rows])
            start = time.perf_counter()
            for _ in range(10):
                grammars.fill(works[:rows])
            times[rows, threads] = (time.perf_counter() - start) / 10 * 1e3
    return times


def _fake_work(req_id: str):
    from shared.step import SequenceWork

    return SequenceWork(req_id, [0], 1, [0], True, SamplingParams())


def _allowed(bits: torch.Tensor, vocab: int) -> list[int]:
    ids = torch.arange(vocab)
    return ids[(bits.repeat_interleave(32)[:vocab] >> (ids % 32)) & 1 == 1].tolist()


def prepare_model(args: argparse.Namespace) -> tuple[str, str]:
    """(model folder, description)."""
    from workers.default_model import fetch_default_model

    if args.model:
        return args.model, args.model
    if args.smoke:
        folder = Path(checkpoint_folder(1 << 26)) / "tiny"
        return str(tiny_llama_with_smollm2_tokenizer(folder)), "tiny random llama, SmolLM2's vocab"
    if args.device == "cpu":
        return str(fetch_default_model()), "SmolLM2-135M-Instruct"
    folder = checkpoint_folder(17 << 30)
    tokenizer = Path(args.tokenizer) if args.tokenizer else None
    write_llama3_8b_with_smollm2_tokenizer(folder, torch.device(args.device), tokenizer)
    return str(folder), f"Llama-3-8B shape, vocab {SMOLLM2_VOCAB_SIZE:,}, random weights"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--model", help="a model folder with a tokenizer (default: a random Llama-3-8B "
                                        "shape with SmolLM2's tokenizer on cuda, SmolLM2 on cpu)")
    parser.add_argument("--tokenizer", help="cuda: folder with SmolLM2's tokenizer files (default: the "
                                            "default model's)")
    parser.add_argument("--smoke", action="store_true", help="a tiny random model, small sizes (CPU check)")
    parser.add_argument("--batch", type=int, help="rows of the decode passes (default 64; 16 with --smoke)")
    parser.add_argument("--mixed-batch", type=int, help="rows of the mixed pass, a quarter constrained "
                                                        "(default 256; 32 with --smoke)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, help="timed decode steps per pass (default 64 cuda, 8 cpu)")
    parser.add_argument("--requests", type=int, help="throughput workload (default 500 cuda, 24 cpu)")
    parser.add_argument("--output-len", type=int, help="tokens per request there (default 128 cuda, 16 cpu)")
    parser.add_argument("--threads", type=int, help="torch threads on cpu (default: torch's)")
    parser.add_argument("--async-scheduling", choices=("on", "off"),
                        help="default: the device's (on for cuda, off for cpu)")
    args = parser.parse_args(argv)
    print_command()
    configure_logging("WARNING")
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    num_steps = args.steps or (64 if on_gpu else 4 if args.smoke else 8)
    args.batch = args.batch or (16 if args.smoke else 64)
    mixed_batch = args.mixed_batch = args.mixed_batch or (32 if args.smoke else 256)
    num_requests = args.requests or (500 if on_gpu else 16)
    output_len = args.output_len or (128 if on_gpu else 8)
    fill_rows = tuple(r // 4 for r in FILL_ROWS[:2]) if args.smoke else FILL_ROWS
    fill_threads = tuple(t for t in FILL_THREADS if t <= max(2, available_cores()))
    folder, description = prepare_model(args)
    max_seqs = max(args.batch, mixed_batch)
    async_scheduling = None if args.async_scheduling is None else args.async_scheduling == "on"
    config = EngineConfig.for_device(device.type, model=folder, device=args.device, dtype=args.dtype,
                                     max_num_seqs=max_seqs,
                                     max_num_batched_tokens=max(2048, max_seqs * args.prompt_len),
                                     cuda_graph_max_batch_size=max_seqs, num_threads=args.threads,
                                     async_scheduling=async_scheduling)
    args.async_scheduling = "on" if config.async_scheduling else "off"
    rng = random.Random(0)
    with LLMEngine(config) as engine:
        vocab = min(engine.model_config.vocab_size, SMOLLM2_VOCAB_SIZE)

        def prompts(n: int, length: int | None = None) -> list[list[int]]:
            return [[rng.randrange(3, vocab) for _ in range(length or rng.randint(args.prompt_len // 2,
                                                                                    args.prompt_len * 4))]
                    for _ in range(n)]

        small, large = prompts(args.batch, args.prompt_len), prompts(mixed_batch, args.prompt_len)
        every, none = [GRAMMAR] * args.batch, [None] * args.batch
        decode_pass(engine, "warm-up", small, every, 4, device)  # compiles the schema
        decode_pass(engine, "warm-up", small, none, 4, device)
        free = decode_pass(engine, "(a)", small, none, num_steps, device)
        constrained = decode_pass(engine, "(b)", small, every, num_steps, device)
        probes = Probes()
        probed_pass = decode_pass(engine, "(c)", small, every, num_steps, device, probes)
        quarter = [GRAMMAR if i % 4 == 0 else None for i in range(mixed_batch)]
        mixed_free = decode_pass(engine, "(d)", large, [None] * mixed_batch, num_steps, device)
        mixed = decode_pass(engine, "(e)", large, quarter, num_steps, device)
        workload = prompts(num_requests)
        throughput(engine, workload[:8], 4, GRAMMAR)  # warm-up of generate's shapes
        free_tps = throughput(engine, workload, output_len, None)
        constrained_tps = throughput(engine, workload, output_len, GRAMMAR)
        fills = fill_scaling(engine, rng, fill_rows, fill_threads)
    print_tables(args, description, num_steps, free, constrained, probed_pass, probes, mixed_free, mixed,
                 (num_requests, output_len, free_tps, constrained_tps), fills)


def print_tables(args, description, num_steps, free, constrained, probed_pass, probes, mixed_free, mixed,
                 workload, fills) -> None:
    n = len(probed_pass.step_s)
    pick, fill, apply, accept = (getattr(probes, k) / n * 1e3 for k in ("pick", "fill", "apply", "accept"))
    hidden = probes.num_hidden / max(1, probes.num_fills)
    exposed_fill = fill * (1 - hidden) if args.device.startswith("cuda") else fill
    base = free.mean_ms
    num_requests, output_len, free_tps, constrained_tps = workload
    print(f"\nmodel: {description}; device {args.device}; {num_steps} timed decode steps per pass; "
          f"{available_cores()} cores; torch {torch.__version__}; async scheduling {args.async_scheduling}")
    print("\n| measure | ms per step | of the unconstrained step | target |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| (a) unconstrained decode step, batch {args.batch} | {base:.2f} | 100% | |")
    print(f"| (b) constrained decode step (every row under the schema) | {constrained.mean_ms:.2f} | "
          f"{constrained.mean_ms / base:.1%} | <= 110% |")
    print(f"| grammar time left on the critical path, (b) - (a) | {constrained.mean_ms - base:.2f} | "
          f"{(constrained.mean_ms - base) / base:.1%} | <= 0.5 ms |")
    print(f"| (c) parts: pick the constrained rows (schedule) | {pick:.3f} | {pick / base:.1%} | |")
    print(f"| (c) parts: fill the bitmask ({args.batch} rows, host; hidden behind the forward in "
          f"{hidden:.0%} of steps) | {fill:.3f} | {fill / base:.1%} | |")
    print(f"| (c) parts: apply it to the logits ({args.device}, synchronised) | {apply:.3f} | "
          f"{apply / base:.1%} | |")
    print(f"| (c) parts: matchers accept the tokens | {accept:.3f} | {accept / base:.1%} | |")
    critical = pick + exposed_fill + apply + accept
    print(f"| (c) parts on the critical path (pick + unhidden fill + apply + accept) | {critical:.3f} | "
          f"{critical / base:.1%} | <= 0.5 ms |")
    print(f"| (d) unconstrained decode step, batch {args.mixed_batch} | {mixed_free.mean_ms:.2f} | 100% | |")
    print(f"| (e) the same rows, a quarter constrained | {mixed.mean_ms:.2f} | "
          f"{mixed.mean_ms / mixed_free.mean_ms:.1%} | <= 105% |")
    print(f"\nthroughput, {num_requests} requests x {output_len} output tokens (prompts of random length):")
    print("\n| workload | output tok/s | of unconstrained | target |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| unconstrained | {free_tps:,.0f} | 1.00 | |")
    print(f"| every request under the JSON schema | {constrained_tps:,.0f} | "
          f"{constrained_tps / free_tps:.2f} | >= 0.85 |")
    print("\nbitmask fill, ms (xgrammar's batch matcher; rows walked into their own states):")
    threads = sorted({t for _, t in fills})
    print("\n| rows | " + " | ".join(f"{t} thread{'s' * (t > 1)}" for t in threads) + " |")
    print("| ---: |" + " ---: |" * len(threads))
    for rows in sorted({r for r, _ in fills}):
        print(f"| {rows} | " + " | ".join(f"{fills[rows, t]:.3f}" for t in threads) + " |")


if __name__ == "__main__":
    main()
