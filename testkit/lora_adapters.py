"""Random LoRA adapters in the PEFT format, made on the fly by peft itself for a base folder.

PEFT starts B at zero (an adapter that changes nothing until trained); here A and B are both
drawn at random, with B's std chosen so each delta moves the logits enough to change greedy
tokens: a loader that drops an adapter, a projection or the scaling is caught by the tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

LORA_STD = 0.2  # of A and B: each delta then moves the logits as much as a base projection does


def make_random_adapter(base: Path, folder: Path, *, rank: int, target_modules: list[str],
                        lora_alpha: float | None = None, seed: int = 0, use_rslora: bool = False) -> Path:
    """Write a PEFT LoRA adapter for the base model folder `base` into `folder`; returns `folder`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=lora_alpha if lora_alpha is not None else 2 * rank,
                        target_modules=target_modules, lora_dropout=0.0, use_rslora=use_rslora)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * LORA_STD)
    folder = Path(folder)
    peft_model.save_pretrained(folder, safe_serialization=True)
    return folder


def load_hf_with_adapter(base: Path, adapter: Path):
    """transformers' model of `base` with the adapter applied, unmerged (PEFT's own forward)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).eval()
