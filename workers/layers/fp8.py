"""FP8 e4m3 numbers shared by the weight, activation and KV-cache paths: the dtype, its range,
and the per-token activation quantization in PyTorch (the reference the Triton kernels of
triton_quant.py match, and the path of devices without Triton)."""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# A row of zeros still gets a positive scale, so dividing by it stays finite.
MIN_SCALE = 1e-12


class QuantizedActivation(NamedTuple):
    """An activation already cast to e4m3, one scale per token: what an fp8 linear multiplies.
    Produced by the kernel before the linear (RMSNorm, SiLU-mul) when it fuses the quant."""

    data: torch.Tensor  # [num_tokens, width] float8_e4m3fn
    scale: torch.Tensor  # [num_tokens, 1] float32: data * scale ~ the activation
    dtype: torch.dtype  # the activations' dtype, and the linear's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self) -> torch.Tensor:
        return (self.data.to(torch.float32) * self.scale).to(self.dtype)


def quantize_activation(x: torch.Tensor) -> QuantizedActivation:
    """x: [num_tokens, width] -> e4m3 rows, each scaled so that its amax maps to 448 (dynamic)."""
    x_scale = (x.abs().amax(dim=1, keepdim=True).to(torch.float32) / FP8_MAX).clamp(min=MIN_SCALE)
    data = (x.to(torch.float32) / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return QuantizedActivation(data, x_scale, x.dtype)
