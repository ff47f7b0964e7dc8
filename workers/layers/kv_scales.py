"""Where each layer's K and V scales of an FP8 KV cache come from (stored = value / scale).

1. **The checkpoint's**, when it has them: one scalar per layer for K and one for V, under any
   of the names the FP8 tools write (`CHECKPOINT_SCALES`): `self_attn.k_scale` / `v_scale`,
   compressed-tensors' `self_attn.k_proj.output_scale` / `v_proj.output_scale`, ModelOpt's
   `self_attn.k_proj.k_scale` / `v_proj.v_scale`, and AutoFP8's older `self_attn.kv_scale` (one
   scale for both). They are used as stored.
2. **Measured** otherwise (`calculate_kv_scales`, on by default where the checkpoint has none):
   the first real step measures each layer's amax of K (after the rotary embedding) and of V
   over its tokens, and fixes the scale for good at the smallest power of two that maps that
   amax to at most `FP8_MAX / HEADROOM` (112 of 448). The headroom is for later prompts whose
   K/V reach further than the first one's. A power of two changes only each stored element's
   exponent, so wherever nothing saturates or underflows the cache holds the mantissas a unit
   scale would: on a model whose K/V fit e4m3 (SmolLM2: |K| <= 20, |V| <= 13) the measured
   scale reads as the unit scale does, and a model whose K/V exceed +-448 (Qwen2's keys reach
   the thousands; vLLM measured its perplexity 34.8 under unit scales, 22.6 with measured ones)
   keeps them instead of saturating them. With --calculate-kv-scales on, measuring replaces a
   checkpoint's scales; off, a layer without checkpoint scales keeps 1.0 (vLLM's default).

The scales live in device memory (a float32 scalar parameter per layer, read by the kernels
through a pointer), so CUDA graphs captured before the measurement replay with the measured
values. The measurement itself is Python control flow that a graph would skip: the model runner
runs steps eagerly until it is done (`KvScaleMeasurement.is_pending`), and measuring starts only
after the graphs' capture, whose warm-up passes run on dummy inputs. A scale fixed before the
first block is written keeps every block's bytes independent of the step that wrote it, which
prefix caching and preemption rely on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shared.errors import ModelLoadError
from workers.layers.fp8 import FP8_DTYPE, FP8_MAX

HEADROOM = 4  # the measured amax maps to at most FP8_MAX / HEADROOM
# The smallest scale a measurement gives (an all-zero K or V: any scale reads back zeros).
MIN_MEASURED_SCALE = 2.0**-40

# A checkpoint tensor's name ending -> the scales of our attention layer (`self_attn.attn`) it fills.
CHECKPOINT_SCALES: dict[str, tuple[str, ...]] = {
    ".self_attn.k_scale": ("k_scale",),
    ".self_attn.v_scale": ("v_scale",),
    ".self_attn.k_proj.output_scale": ("k_scale",),
    ".self_attn.v_proj.output_scale": ("v_scale",),
    ".self_attn.k_proj.k_scale": ("k_scale",),
    ".self_attn.v_proj.v_scale": ("v_scale",),
    ".self_attn.kv_scale": ("k_scale", "v_scale"),
}
# Scales some checkpoints carry for FP8 attention math (q and the softmax probabilities
# quantized), which we do not run: the attention multiplies in the activations' dtype.
UNUSED_SCALES = (".self_attn.q_scale", ".self_attn.prob_scale", ".self_attn.q_proj.output_scale")
# Our parameter names of the scales, which a checkpoint may lack.
SCALE_PARAMETERS = (".attn.k_scale", ".attn.v_scale")


def checkpoint_targets(name: str) -> tuple[str, ...] | None:
    """Our parameter names that checkpoint tensor `name` fills when it is a KV scale, else None."""
    for suffix, scales in CHECKPOINT_SCALES.items():
        if name.endswith(suffix):
            layer = name[: -len(suffix)]
            return tuple(f"{layer}.self_attn.attn.{scale}" for scale in scales)
    return None


def is_unused_scale(name: str) -> bool:
    return name.endswith(UNUSED_SCALES)


def is_scale_parameter(name: str) -> bool:
    """Whether our parameter `name` is a KV scale (which a checkpoint need not hold)."""
    return name.endswith(SCALE_PARAMETERS)


def measured_scale(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two s with amax(|x|) / s <= FP8_MAX / HEADROOM: a float32 scalar on
    x's device, computed there (no host round trip). frexp and ldexp are exact, so a tensor
    scaled by a power of two gets a scale scaled by the same power."""
    raw = (x.abs().amax().to(torch.float32) * (HEADROOM / FP8_MAX)).clamp(min=MIN_MEASURED_SCALE)
    mantissa, exponent = torch.frexp(raw)  # raw = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # raw is a power of two itself
    return torch.ldexp(torch.ones_like(raw), exponent)


def load_scale(param: nn.Parameter, tensor_slice, name: str) -> None:
    """A checkpoint's KV scale (a scalar, or one element) into `param`; anything else is refused."""
    loaded = tensor_slice[...]  # ([:] fails on the 0-d tensors most tools write)
    if loaded.numel() != 1:
        raise ValueError(f"{name}: a KV cache scale must be one number per layer, got shape "
                         f"{tuple(loaded.shape)} (per-head or per-channel KV scales are not supported)")
    value = float(loaded.reshape(()).to(torch.float32))
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name}: a KV cache scale must be positive and finite, got {value}")
    param.data.fill_(value)


@dataclass
class KvScaleMeasurement:
    """The attention layers that measure their scales in the first real step."""

    layers: list[nn.Module] = field(default_factory=list)

    @property
    def is_pending(self) -> bool:
        """Whether a layer still waits for its measurement (the runner then runs steps eagerly)."""
        if self.layers and not any(layer.is_measuring for layer in self.layers):
            self.layers = []
        return bool(self.layers)


def prepare(model: nn.Module, cache_dtype: torch.dtype, calculate: bool | None,
            log: Any = None) -> KvScaleMeasurement:
    """Decide each attention layer's scales (the module docstring's order) once its weights are
    loaded and the CUDA graphs captured. calculate: None (auto) measures where the checkpoint
    brought no scales; True measures everywhere; False never measures. `log`: a structlog logger
    that gets one line of how many layers take each source."""
    measurement = KvScaleMeasurement()
    if cache_dtype != FP8_DTYPE:
        return measurement  # the scales are never applied
    for name, module in model.named_modules():
        if not hasattr(module, "kv_scale_source"):
            continue
        if module.checkpoint_scales and module.kv_scale_source != "checkpoint":
            raise ModelLoadError(f"the checkpoint has {sorted(module.checkpoint_scales)} for {name} but not "
                                 "both K and V scales")
        from_checkpoint = module.kv_scale_source == "checkpoint"
        if calculate or (calculate is None and not from_checkpoint):
            module.is_measuring = True
            measurement.layers.append(module)
    if log is not None:
        log.info("kv_cache_scales", **sources(model))
    return measurement


def sources(model: nn.Module) -> dict[str, int]:
    """How many attention layers take their scales from each source (for the load log)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if hasattr(module, "kv_scale_source"):
            source = "measured" if module.is_measuring else module.kv_scale_source
            counts[source] = counts.get(source, 0) + 1
    return counts
