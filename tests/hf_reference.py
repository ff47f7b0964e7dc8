"""Greedy references from Hugging Face transformers, and the comparison rule we apply.

The rule (as vLLM's check_logprobs_close): our greedy tokens must equal transformers'
token for token; where they first differ, the comparison may stop only if transformers'
own top-2 logits at that step were a genuine near-tie (gap under `NEAR_TIE`), since
either token is then a correct greedy choice up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE = 1e-4


@dataclass
class GreedyReference:
    token_ids: list[int]
    top2_gaps: list[float]  # logit gap between the best and second-best token, per step


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> GreedyReference:
    """transformers' greedy continuation of one prompt, EOS ignored."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
        )
    gaps = []
    for scores in out.scores:
        top2 = scores[0].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    return GreedyReference(out.sequences[0, len(prompt_ids):].tolist(), gaps)


def assert_greedy_matches(ours: list[int], ref: GreedyReference, *, allow_near_tie: bool) -> None:
    assert len(ours) == len(ref.token_ids), f"{len(ours)} tokens, transformers made {len(ref.token_ids)}"
    for i, (a, b) in enumerate(zip(ours, ref.token_ids, strict=True)):
        if a == b:
            continue
        if allow_near_tie and ref.top2_gaps[i] < NEAR_TIE:
            return  # a genuine near-tie: both tokens are correct greedy choices
        raise AssertionError(
            f"token {i} differs: ours {a}, transformers {b} (top-2 gap {ref.top2_gaps[i]:.2e});\n"
            f"ours {ours}\nhf   {ref.token_ids}"
        )
