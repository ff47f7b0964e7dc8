"""What grammar-constrained decoding costs a decode step: the mask's time per step at batch 64,
against unconstrained decoding of the same requests in the same run.

    .venv/bin/python scripts/bench_structured.py                  # CPU: SmolLM2-135M, float32
    python scripts/bench_structured.py --device cuda              # GPU: Llama-3-8B shape, bf16

Three passes over the same 64 requests (prompts of random ids, sampled at temperature 1 with
a seed each, EOS ignored where no grammar ends them), each after the prompts are in the cache,
timing only decode steps where all 64 rows sample:
  (a) unconstrained;
  (b) every row constrained by one JSON schema whose answer cannot end within the run (a long
      free string, then more fields), so all 64 matchers work every step;
  (c) as (b), with the mask's parts timed: the scheduler filling the bitmask of the 64 rows
      (xgrammar, CPU), the rank applying it to the logits (on the device, synchronised to time
      it), the matchers accepting the sampled tokens.
The headline is (c)'s mask time (fill + apply + accept) as a share of (a)'s step time; (b)/(a)
is the whole slowdown seen from outside. Prints the command first and a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import torch

import workers.model_runner as model_runner_module
from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.logging import configure_logging
from shared.sampling import SamplingParams
from testkit.checkpoints import SMOLLM2_VOCAB_SIZE, copy_tokenizer
from testkit.random_models import LLAMA3_8B, checkpoint_folder, random_llama
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


@dataclass
class PartTimes:
    """Seconds spent in each part of the mask over the timed steps."""

    fill: float = 0.0
    apply: float = 0.0
    accept: float = 0.0


@dataclass
class Pass:
    name: str
    step_s: list[float] = field(default_factory=list)  # timed decode steps
    parts: PartTimes | None = None

    @property
    def mean_step_s(self) -> float:
        return sum(self.step_s) / len(self.step_s)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def timed_mask_parts(engine: LLMEngine, device: torch.device, parts: PartTimes, timing: list[bool]):
    """Wrap the scheduler's fill/accept and the runner's apply with timers (counted while
    timing[0] is true); the apply is synchronised on CUDA so that its kernel is what is timed."""
    grammars = engine.scheduler.grammars
    fill, accept, apply = grammars.fill, grammars.accept, model_runner_module.apply_token_mask

    def timed(fn, name: str, synchronise: bool):
        def wrapper(*args, **kwargs):
            if synchronise:
                sync(device)
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            if synchronise:
                sync(device)
            if timing[0]:
                setattr(parts, name, getattr(parts, name) + time.perf_counter() - start)
            return result
        return wrapper

    grammars.fill = timed(fill, "fill", False)
    grammars.accept = timed(accept, "accept", False)
    model_runner_module.apply_token_mask = timed(apply, "apply", True)
    try:
        yield
    finally:
        del grammars.fill, grammars.accept
        model_runner_module.apply_token_mask = apply


def run_pass(engine: LLMEngine, name: str, prompts: list[list[int]], num_steps: int, grammar: str | None,
             device: torch.device, time_parts: bool) -> Pass:
    result = Pass(name)
    req_ids = [engine.add_request(ids, SamplingParams(temperature=1.0, seed=i, max_tokens=num_steps + 8,
                                                      ignore_eos=grammar is None, grammar=grammar))
               for i, ids in enumerate(prompts)]
    requests = [engine.scheduler.get_request(r) for r in req_ids]
    timing = [False]
    parts = PartTimes()
    context = timed_mask_parts(engine, device, parts, timing) if time_parts else contextlib.nullcontext()
    with context:
        while engine.has_unfinished_requests():
            # Timed: decode steps with every row present and past its prompt.
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
    result.parts = parts if time_parts else None
    return result


def prepare_model(args: argparse.Namespace) -> tuple[str, str]:
    """(model folder, description)."""
    from workers.default_model import fetch_default_model

    if args.model:
        return args.model, args.model
    if args.device == "cpu":
        return str(fetch_default_model()), "SmolLM2-135M-Instruct"
    folder = checkpoint_folder(17 << 30)
    model = random_llama({**LLAMA3_8B, "vocab_size": SMOLLM2_VOCAB_SIZE}, torch.device(args.device))
    model.save_pretrained(folder)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    copy_tokenizer(fetch_default_model(), Path(folder))
    return str(folder), f"Llama-3-8B shape, vocab {SMOLLM2_VOCAB_SIZE:,}, random weights"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--model", help="a model folder with a tokenizer (default: SmolLM2 on cpu, "
                                        "a random Llama-3-8B shape with SmolLM2's tokenizer on cuda)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, help="timed decode steps per pass (default 16 cpu, 64 cuda)")
    parser.add_argument("--threads", type=int, help="torch threads on cpu (default: torch's)")
    args = parser.parse_args(argv)
    print_command()
    configure_logging("WARNING")
    device = torch.device(args.device)
    num_steps = args.steps or (16 if device.type == "cpu" else 64)
    folder, description = prepare_model(args)
    config = EngineConfig(model=folder, device=args.device, dtype=args.dtype, max_num_seqs=args.batch,
                          max_num_batched_tokens=max(2048, args.batch * args.prompt_len),
                          cuda_graph_max_batch_size=args.batch, num_threads=args.threads)
    rng = random.Random(0)
    with LLMEngine(config) as engine:
        vocab = engine.model_config.vocab_size
        prompts = [[rng.randrange(3, min(vocab, SMOLLM2_VOCAB_SIZE)) for _ in range(args.prompt_len)]
                   for _ in range(args.batch)]
        run_pass(engine, "warm-up", prompts, 4, GRAMMAR, device, time_parts=False)  # compiles the schema
        run_pass(engine, "warm-up", prompts, 4, None, device, time_parts=False)
        free = run_pass(engine, "(a) unconstrained", prompts, num_steps, None, device, time_parts=False)
        constrained = run_pass(engine, "(b) constrained", prompts, num_steps, GRAMMAR, device,
                               time_parts=False)
        timed = run_pass(engine, "(c) constrained, parts timed", prompts, num_steps, GRAMMAR, device,
                         time_parts=True)
    n = len(timed.step_s)
    fill, apply, accept = (timed.parts.fill / n, timed.parts.apply / n, timed.parts.accept / n)
    mask = fill + apply + accept
    base = free.mean_step_s
    print(f"\nmodel: {description}; device {args.device}; batch {args.batch}; {num_steps} timed decode steps "
          f"per pass; torch {torch.__version__}")
    print("\n| measure | ms per step | share of unconstrained step |")
    print("| --- | ---: | ---: |")
    print(f"| (a) unconstrained decode step | {base * 1e3:.2f} | 100% |")
    print(f"| (b) constrained decode step | {constrained.mean_step_s * 1e3:.2f} | "
          f"{constrained.mean_step_s / base:.1%} |")
    print(f"| mask: fill the bitmask ({args.batch} rows, CPU) | {fill * 1e3:.2f} | {fill / base:.1%} |")
    print(f"| mask: apply it to the logits ({args.device}) | {apply * 1e3:.2f} | {apply / base:.1%} |")
    print(f"| mask: matchers accept the tokens | {accept * 1e3:.2f} | {accept / base:.1%} |")
    print(f"| **mask time per step** | **{mask * 1e3:.2f}** | **{mask / base:.1%}** |")


if __name__ == "__main__":
    main()
