"""Perplexity of a text under a loaded model: how we judge what quantization costs in quality.

The text is read in windows of at most `window` tokens, each one prefill through the runner's
own model code (the paged KV cache included), so what is measured is exactly what serves.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from shared.sampling import SamplingParams
from shared.step import SequenceWork, StepBatch
from workers.model_runner import ModelRunner
from workers.step_inputs import build_step_inputs


@torch.inference_mode()
def perplexity(runner: ModelRunner, token_ids: list[int], window: int = 512) -> float:
    """exp(mean negative log-likelihood) of every token after the first of each window.

    Single-rank runners only (every rank would need the same call under TP)."""
    if runner.tp.size != 1:
        raise ValueError("perplexity runs on a single-rank runner")
    blocks_needed = -(-window // runner.block_size)
    if blocks_needed > runner.num_kv_blocks:
        raise ValueError(f"a {window}-token window needs {blocks_needed} KV blocks; "
                         f"the runner has {runner.num_kv_blocks}")
    total_nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start : start + window]
        if len(chunk) < 2:
            break
        work = SequenceWork("perplexity", chunk, 0, list(range(blocks_needed)), True,
                            SamplingParams(temperature=0.0))
        inputs = build_step_inputs(StepBatch(0, [work]), runner.block_size, runner.device)
        hidden = runner.model(inputs.token_ids, inputs.positions, runner.kv_caches, inputs.meta)
        logits = runner.model.compute_logits(hidden).float()  # [len(chunk), vocab]
        targets = torch.tensor(chunk[1:], device=logits.device)
        total_nll += float(F.cross_entropy(logits[:-1], targets, reduction="sum"))
        count += len(chunk) - 1
    if count == 0:
        raise ValueError("perplexity needs a text of at least 2 tokens")
    return math.exp(total_nll / count)
