"""A checkpoint whose K and V are `factor` times the original's while the model computes the same
function: k_proj and v_proj (and their biases) multiplied by `factor`, q_proj (and its bias) and
o_proj divided by it. Attention scores q . k and the output o(v) are unchanged, and with a power
of two every product is exact in floating point, so a full-precision model gives the very same
logits. What changes is only the K/V range, as in real models whose keys reach far past e4m3's
+-448 (Qwen2's): the FP8 KV cache's scales must follow it."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# tensor name ending -> what it is multiplied by (f: the factor)
_RESCALED = {
    ".self_attn.k_proj.weight": lambda f: f, ".self_attn.k_proj.bias": lambda f: f,
    ".self_attn.v_proj.weight": lambda f: f, ".self_attn.v_proj.bias": lambda f: f,
    ".self_attn.q_proj.weight": lambda f: 1 / f, ".self_attn.q_proj.bias": lambda f: 1 / f,
    ".self_attn.o_proj.weight": lambda f: 1 / f,
}


def rescaled_kv_checkpoint(folder: Path, out: Path, factor: float,
                           extra: dict[str, torch.Tensor] | None = None) -> Path:
    """A copy of `folder` (Llama or Qwen2 naming, no q/k norms) with K and V `factor` times
    larger; `extra` tensors (KV scales, say) are saved beside the weights."""
    out.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            shutil.copy(path, out / path.name)
    for path in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(path))
        for name, tensor in tensors.items():
            for suffix, multiplier in _RESCALED.items():
                if name.endswith(suffix):
                    tensors[name] = (tensor.to(torch.float64) * multiplier(factor)).to(tensor.dtype)
        save_file(tensors, str(out / path.name))
    if extra:
        save_file({name: t.contiguous() for name, t in extra.items()}, str(out / "kv_scales.safetensors"))
    return out
