"""Correctness of the CUDA path in bf16, run by hand on a GPU machine.

Prints one table: for SmolLM2 (or --model), the bf16 engine on CUDA against transformers in
bf16 on the same GPU: how many prompts match for all of --num-tokens greedy tokens, the mean
matching prefix, the logits' relative difference at the prompts' last position, and the
chat answer to "What is the capital of France?".

    python scripts/gpu_check.py [--model PATH] [--num-prompts 16] [--num-tokens 32]
"""

from __future__ import annotations

import argparse

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import torch

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from testkit.hf_agreement import agreement
from testkit.runs import print_command
from testkit.workloads import uniform_workload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--num-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    print_command()
    from transformers import AutoModelForCausalLM

    if args.model is None:
        from workers.default_model import fetch_default_model

        args.model = str(fetch_default_model())
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    vocab = hf.config.vocab_size
    prompts = uniform_workload(args.num_prompts, vocab, prompt_lens=(4, 300), output_lens=(1, 1)).prompts
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                    num_kv_blocks=4096))
    full, prefixes, rel = agreement(engine, hf, prompts, args.num_tokens, args.device)
    question = "What is the capital of France?"
    [chat] = engine.generate([question], SamplingParams(temperature=0.0, max_tokens=32), chat=True)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"| check ({args.dtype}, {where}) | value |")
    print("| --- | --- |")
    print(f"| prompts matching transformers for all {args.num_tokens} greedy tokens "
          f"| {full}/{len(prompts)} |")
    at_least = min(16, args.num_tokens)  # the bar: at least 16 tokens on most prompts
    print(f"| prompts matching for at least {at_least} greedy tokens "
          f"| {sum(p >= at_least for p in prefixes)}/{len(prompts)} |")
    print(f"| mean matching prefix (tokens) | {sum(prefixes) / len(prefixes):.1f} |")
    print(f"| logits max relative difference at the last prompt position (median, max) | "
          f"{sorted(rel)[len(rel) // 2]:.2e}, {max(rel):.2e} |")
    print(f"| chat answer | {chat.text!r} |")
    engine.close()


if __name__ == "__main__":
    main()
