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


ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_random_adapter(base: Path, folder: Path, *, rank: int, target_modules: list[str] | None = None,
                         seed: int = 0, std: float = 0.01) -> Path:
    """A PEFT-format adapter for the base folder `base`, written directly (no model built: fast for
    an 8B-shaped base): every layer's targets get A [rank, in] and B [out, rank] ~ normal(0, std),
    in bf16. Returns `folder`."""
    import json

    from safetensors.torch import save_file

    from shared.lora_config import projection_shapes
    from shared.model_config import load_model_config

    targets = target_modules or ALL_TARGETS
    cfg = load_model_config(base)
    shapes = projection_shapes(cfg)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in targets:
            out_features, in_features = shapes[module]
            parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            a = torch.randn(rank, in_features, generator=generator) * std
            b = torch.randn(out_features, rank, generator=generator) * std
            tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a.bfloat16(), b.bfloat16()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
              "base_model_name_or_path": str(base), "bias": "none", "lora_dropout": 0.0}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder
