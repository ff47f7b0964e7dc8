"""Masks the logits of grammar-constrained rows before sampling (the bitmask comes with the
batch from the scheduler, scheduler/grammar.py). Rows without a grammar are not touched."""

from __future__ import annotations

import torch

from shared.step import TokenBitmask


def apply_token_mask(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """Set to -inf, in place, the logits of every token the row's grammar refuses now."""
    # logits: [num_sampled, vocab]; mask.bits: int32 [len(mask.rows), ceil(vocab / 32)] on the CPU
    import xgrammar as xgr

    bits = mask.bits.to(logits.device, non_blocking=True)
    if len(mask.rows) == logits.shape[0]:
        xgr.apply_token_bitmask_inplace(logits, bits)
        return
    # Only the constrained rows: copied out, masked, written back.
    rows = torch.tensor(mask.rows, device=logits.device)
    constrained = logits[rows]
    xgr.apply_token_bitmask_inplace(constrained, bits)
    logits[rows] = constrained
