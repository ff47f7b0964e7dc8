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
from shared.step import SequenceWork, StepBatch
from testkit.runs import print_command
from testkit.workloads import greedy, uniform_workload


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
    ours = engine.generate(prompts, greedy(args.num_tokens))

    full, prefixes, rel = 0, [], []
    for prompt, result in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ids = torch.tensor([prompt], device=args.device)
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.num_tokens,
                              min_new_tokens=args.num_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
            ref_logits = hf(ids).logits[0, -1].float()
        pairs = enumerate(zip(result.token_ids, ref, strict=True))
        prefix = next((i for i, (a, b) in pairs if a != b), len(ref))
        prefixes.append(prefix)
        full += prefix == len(ref)
        blocks = list(range(2048, 2048 + -(-len(prompt) // 16)))  # blocks no request holds (4096 in all)
        work = SequenceWork("check", prompt, 0, blocks, True, greedy(args.num_tokens))
        logits, _ = engine.executor.runner.forward(StepBatch(-1, [work]), use_graphs=False)
        our_logits = logits[0].float().to(args.device)
        rel.append(float((our_logits - ref_logits).abs().max() / ref_logits.abs().max()))

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
