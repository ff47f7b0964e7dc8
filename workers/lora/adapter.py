"""An adapter's tensors, read from its PEFT safetensors file and checked against the base.

Kept on the host in float32, whole (not this rank's slice: a slot load slices them), with the
scaling folded into B, so that a projection adds B @ (A @ x) and nothing else.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from shared.errors import LoraAdapterError
from shared.lora_config import LoraConfig, projection_shapes
from shared.model_config import ModelConfig

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT drops the adapter's name
# when it saves; an older save may keep it: ...lora_A.default.weight).
_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass
class LoraAdapter:
    name: str
    config: LoraConfig
    # (layer index, PEFT projection name) -> (A [rank, in], B * scaling [out, rank]), float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    load_ms: float = 0.0  # reading and checking the file

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.weights.values())


def load_adapter(name: str, config: LoraConfig, base: ModelConfig) -> LoraAdapter:
    """Read the adapter's tensors; LoraAdapterError names the file and what is wrong with it."""
    start = time.perf_counter()
    path = config.weights_path
    try:
        tensors = load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise _bad(path, f"unreadable safetensors ({exc})") from None
    shapes = projection_shapes(base)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _NAME.match(tensor_name)
        if match is None:
            raise _bad(path, f"tensor {tensor_name!r} is not a LoRA A or B of a layer projection")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if module not in config.target_modules:
            raise _bad(path, f"tensor {tensor_name!r} targets {module!r}, which adapter_config.json "
                             f"does not list (or this base lacks)")
        if layer >= base.num_layers:
            raise _bad(path, f"tensor {tensor_name!r}: the base has {base.num_layers} layers")
        out_features, in_features = shapes[module]
        expected = (config.rank, in_features) if half == "A" else (out_features, config.rank)
        if tuple(tensor.shape) != expected:
            raise _bad(path, f"tensor {tensor_name!r} has shape {tuple(tensor.shape)}, expected {expected} "
                             f"(rank {config.rank} on this base: another base model?)")
        halves.setdefault((layer, module), {})[half] = tensor
    adapter = LoraAdapter(name, config)
    for key, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise _bad(path, f"layer {key[0]} {key[1]} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"].float().contiguous(), (pair["B"].float() * config.scaling).contiguous()
        adapter.weights[key] = (a, b)
    if not adapter.weights:
        raise _bad(path, "holds no LoRA tensors")
    adapter.load_ms = (time.perf_counter() - start) * 1000
    return adapter


def _bad(path: str, problem: str) -> LoraAdapterError:
    return LoraAdapterError(f"LoRA adapter {path}: {problem}", param="lora_path")
