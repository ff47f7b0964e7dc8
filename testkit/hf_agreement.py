"""gpu_check.py's agreement: the engine's greedy tokens and last-position logits against
transformers' on the same checkpoint, dtype and device, prompt by prompt."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shared.step import SequenceWork, StepBatch
from testkit.workloads import greedy

if TYPE_CHECKING:
    from scheduler.engine import LLMEngine


def agreement(engine: LLMEngine, hf: torch.nn.Module, prompts: list[list[int]], num_tokens: int,
              device: str) -> tuple[int, list[int], list[float]]:
    """(prompts matching for all num_tokens greedy tokens, each prompt's matching prefix, each
    prompt's max relative logits difference at its last position). The engine's logits come from
    a forward on blocks 2048 onwards, which no request holds (it needs 4,096 KV blocks)."""
    ours = engine.generate(prompts, greedy(num_tokens))
    full, prefixes, rel = 0, [], []
    for prompt, result in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ids = torch.tensor([prompt], device=device)
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                              min_new_tokens=num_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
            ref_logits = hf(ids).logits[0, -1].float()
        pairs = enumerate(zip(result.token_ids, ref, strict=True))
        prefix = next((i for i, (a, b) in pairs if a != b), len(ref))
        prefixes.append(prefix)
        full += prefix == len(ref)
        blocks = list(range(2048, 2048 + -(-len(prompt) // 16)))  # blocks no request holds (4096 in all)
        work = SequenceWork("check", prompt, 0, blocks, True, greedy(num_tokens))
        logits, _ = engine.executor.runner.forward(StepBatch(-1, [work]), use_graphs=False)
        our_logits = logits[0].float().to(device)
        rel.append(float((our_logits - ref_logits).abs().max() / ref_logits.abs().max()))
    return full, prefixes, rel
