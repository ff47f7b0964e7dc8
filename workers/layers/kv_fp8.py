"""The FP8 KV cache (`--kv-cache-dtype fp8`): K and V stored as float8 e4m3, one byte each.

Scales: one per layer for K and one for V, static once set. Each layer's `PagedAttention` holds
its `k_scale` and `v_scale` (stored = value / scale, read = stored * scale) as float32 scalars in
device memory; kv_scales.py says where they come from: the checkpoint's, else measured in the
first real step (a power of two with headroom), else 1.0. e4m3 spans +-448 with 3 mantissa bits
at every magnitude from 2^-6 up: K/V past +-448 under a unit scale would saturate (clamped,
never NaN), which measured or calibrated scales prevent. A static scale also means a block's
bytes never depend on which step wrote it, which prefix caching (blocks shared between
requests) and preemption (blocks recomputed) rely on.

Every path reads and writes the cache without an extra pass: the Triton store
(`triton_fused.rope_and_store`) casts as it writes, the Triton attention widens each K/V tile
in registers, and the PyTorch path (CPU) casts what it writes and widens what it gathers.
With an FP8 cache a chunk with nothing cached before it attends over the stored (rounded) K/V
too, as the Triton kernel does, so that a prompt gives the same tokens whether its prefix came
from the cache or was computed in the step.
"""

from __future__ import annotations

import torch

from workers.layers.fp8 import FP8_DTYPE, FP8_MAX


def kv_cache_dtype(name: str, serving_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for a --kv-cache-dtype value."""
    if name == "auto":
        return serving_dtype
    if name == "fp8":
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {name!r}")


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | float) -> torch.Tensor:
    """K or V in the activations' dtype -> what the cache stores. scale: a float32 scalar tensor
    (the layer's, in device memory) or a number."""
    if cache_dtype != FP8_DTYPE:
        return x
    return (x.to(torch.float32) * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def from_cache(stored: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | float) -> torch.Tensor:
    """What the cache stores -> K or V in the activations' dtype."""
    if stored.dtype != FP8_DTYPE:
        return stored
    return (stored.to(torch.float32) * scale).to(dtype)
