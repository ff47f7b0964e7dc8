"""bench_structured.py's measurements: decode steps with and without a JSON schema (timed with
every row present and past its prompt; optionally with the grammar's parts probed), a whole
workload's throughput through `generate`, and the bitmask fill's scaling over threads; the model
they run (a tiny random llama, SmolLM2, or Llama-3-8B's shape with SmolLM2's tokenizer)."""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from scheduler.engine import LLMEngine
from scheduler.grammar import Grammars
from shared.sampling import SamplingParams
from testkit.checkpoints import SMOLLM2_VOCAB_SIZE, tiny_llama_with_smollm2_tokenizer
from testkit.grammar_probes import Probes, probed
from testkit.random_models import checkpoint_folder, write_llama3_8b_with_smollm2_tokenizer
from testkit.roofline import sync

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


@dataclass
class StructuredRun:
    """Every figure of bench_structured.py's tables."""

    free: Pass  # (a)
    constrained: Pass  # (b)
    probed: Pass  # (c)
    probes: Probes
    mixed_free: Pass  # (d)
    mixed: Pass  # (e)
    free_tps: float  # throughput, unconstrained
    constrained_tps: float  # every request under the schema
    fills: dict[tuple[int, int], float]  # (rows, threads) -> ms per fill


def run_passes(engine: LLMEngine, batch: int, mixed_batch: int, prompt_len: int, num_steps: int,
               num_requests: int, output_len: int, fill_rows: tuple[int, ...], fill_threads: tuple[int, ...],
               device: torch.device) -> StructuredRun:
    """Passes (a) to (e), the throughput pair and the fill scaling, on one engine."""
    rng = random.Random(0)
    vocab = min(engine.model_config.vocab_size, SMOLLM2_VOCAB_SIZE)

    def prompts(n: int, length: int | None = None) -> list[list[int]]:
        drawn = []
        for _ in range(n):  # each prompt's length, then its ids
            num_ids = length or rng.randint(prompt_len // 2, prompt_len * 4)
            drawn.append([rng.randrange(3, vocab) for _ in range(num_ids)])
        return drawn

    small, large = prompts(batch, prompt_len), prompts(mixed_batch, prompt_len)
    every, none = [GRAMMAR] * batch, [None] * batch
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
    return StructuredRun(free, constrained, probed_pass, probes, mixed_free, mixed, free_tps, constrained_tps,
                         fills)
