"""A LoRA adapter folder in the PEFT format, checked against the base model before any tensor
is read: the gateway (its load route) and the engine read it from here, neither needs torch.

A PEFT folder holds `adapter_config.json` (rank `r`, `lora_alpha`, `target_modules`, the base it
was trained on...) and `adapter_model.safetensors` (per layer and projection a `lora_A` [r, in]
and a `lora_B` [out, r]). The delta a projection adds is scaling * B @ A @ x, with
scaling = lora_alpha / r (lora_alpha / sqrt(r) with `use_rslora`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from shared.errors import LoraAdapterError
from shared.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The projections an adapter may target, by their PEFT (Hugging Face) names, in layer order.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Bases whose layers carry those names (Qwen v1's c_attn/w1/w2 do not: no adapters there).
LORA_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class LoraConfig:
    path: str  # the adapter's folder
    rank: int
    scaling: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) under rsLoRA
    target_modules: tuple[str, ...]  # as declared, in TARGET_MODULES order (the file may hold fewer)
    base_model: str | None  # base_model_name_or_path, when stated

    @property
    def weights_path(self) -> str:
        return os.path.join(self.path, WEIGHTS_FILE)


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each target projection of the base model."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def _fail(path: str, problem: str) -> LoraAdapterError:
    return LoraAdapterError(f"LoRA adapter {path}: {problem}", param="lora_path")


def read_lora_config(path: str, base: ModelConfig, *, base_path: str | None = None,
                     max_lora_rank: int) -> LoraConfig:
    """The adapter's config, checked against the base and the engine's limits; raises
    LoraAdapterError naming the file and the problem."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise _fail(path, "no such folder")
    if base.model_type not in LORA_MODEL_TYPES:
        raise _fail(path, f"adapters are served on {', '.join(LORA_MODEL_TYPES)} models, "
                          f"not on model_type {base.model_type!r}")
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise _fail(config_path, "missing (a PEFT adapter folder holds adapter_config.json)") from None
    except (OSError, ValueError) as exc:
        raise _fail(config_path, f"unreadable: {exc}") from None
    if not isinstance(raw, dict):
        raise _fail(config_path, "not a JSON object")
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise _fail(os.path.join(path, WEIGHTS_FILE), "missing")
    if raw.get("peft_type", "LORA") != "LORA":
        raise _fail(config_path, f"peft_type {raw.get('peft_type')!r}; only LORA adapters are served")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _fail(config_path, f"r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise _fail(config_path, f"rank {rank} is over max_lora_rank={max_lora_rank}")
    alpha = raw.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise _fail(config_path, f"lora_alpha must be a number, got {alpha!r}")
    # What we would otherwise serve wrongly rather than refuse: each changes the delta's math.
    for key, plain in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"),
                       ("modules_to_save", None), ("rank_pattern", {}), ("alpha_pattern", {})):
        value = raw.get(key)
        if value is not None and value != plain:
            raise _fail(config_path, f"{key}={raw[key]!r} is not supported")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise _fail(config_path, f"target_modules must name projections, got {targets!r}")
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise _fail(config_path, f"target module {unknown[0]!r} is not one this base has "
                                 f"(adapters may target {', '.join(TARGET_MODULES)})")
    base_model = raw.get("base_model_name_or_path") or None
    if base_model and base_path and not _same_base(base_model, base_path):
        raise _fail(config_path, f"made for base {base_model!r}, not for {base_path!r}")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    declared = tuple(t for t in TARGET_MODULES if t in targets)
    return LoraConfig(path, rank, float(scaling), declared, base_model)


def _same_base(stated: str, base_path: str) -> bool:
    """The base an adapter states (a hub id or a path) names this base's folder: their last
    path components agree, case aside (a hub id "org/Name" and a local ".../Name" folder)."""
    def last(name: str) -> str:
        return os.path.basename(os.path.normpath(name)).lower()
    return last(stated) == last(base_path)
