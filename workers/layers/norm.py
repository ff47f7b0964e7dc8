"""RMSNorm, computed in float32 as Hugging Face does, optionally fused with a residual add
(one Triton kernel on CUDA for [tokens, hidden] activations, `triton_fused.rms_norm`), and on
CUDA with the FP8 quant of the linear it feeds (`triton_quant.rms_norm_quant`)."""

from __future__ import annotations

import torch
from torch import nn

from workers.layers import triton_fused, triton_quant
from workers.layers.fp8 import QuantizedActivation


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, *, quantize: bool = False
    ) -> torch.Tensor | QuantizedActivation | tuple[torch.Tensor | QuantizedActivation, torch.Tensor]:
        """Without residual: norm(x). With it: (norm(x + residual), x + residual). `quantize`: the
        next linear takes FP8 input; on CUDA norm(...) then comes out quantized (one kernel)."""
        fused = triton_fused.is_available(x) and x.dim() == 2 and x.stride(-1) == 1
        if quantize and fused and triton_quant.is_available(x):
            normed, res_out = triton_quant.rms_norm_quant(x, self.weight, self.eps, residual)
            return normed if residual is None else (normed, res_out)
        if fused:
            return triton_fused.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
