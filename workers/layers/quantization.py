"""How a linear layer stores its weight and multiplies by it: full precision, FP8 or int8.

Quantized weights keep one scale per output channel (a row of the weight), so a rank's slice
of a column-parallel layer quantizes to exactly the rows of the whole layer's quantization, and
a row-parallel rank scales its own columns. Only the linear layers of the decoder blocks are
quantized; the embedding and the LM head stay in the serving dtype, as in vLLM.

- `fp8`: weights in float8 e4m3, activations scaled per token on the fly (dynamic), the product
  through `torch._scaled_mm` (Hopper's FP8 tensor cores; PyTorch's CPU build has it too).
- `int8`: weight-only; activations stay in the serving dtype and `torch._weight_int8pack_mm`
  multiplies them by the int8 weight and its scales.

Layers pick their method while the model is built, inside `building_with(method)`, so a
quantized model never holds its weights in full precision on the device: a model that only
fits once quantized loads where its bf16 form would not.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
INT8_MAX = 127
# torch._scaled_mm on CUDA wants both matrix dimensions it reads from the weight in multiples
# of 16; smaller or odd layers (tiny test models) multiply a dequantized weight instead.
SCALED_MM_ALIGNMENT = 16


class WeightQuantization:
    """One way of storing a linear layer's weight; subclasses say how."""

    name: str
    storage_dtype: torch.dtype

    def quantize_rows(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A full-precision [out, in] weight -> (its quantized form, one float32 scale per row)."""
        raise NotImplementedError

    def linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x [..., in] @ weight.T, dequantized by `scale` [out]; in x's dtype."""
        raise NotImplementedError

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (weight.to(torch.float32) * scale.unsqueeze(1)).to(dtype)


class Fp8Quantization(WeightQuantization):
    name = "fp8"
    storage_dtype = FP8_DTYPE

    def quantize_rows(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = weight.to(torch.float32)
        scale = (weight.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
        quantized = (weight / scale.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return quantized, scale

    def linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        out_features, in_features = weight.shape
        if out_features % SCALED_MM_ALIGNMENT or in_features % SCALED_MM_ALIGNMENT:
            return F.linear(x, self.dequantize(weight, scale, x.dtype))
        rows = x.reshape(-1, in_features)
        # Dynamic per-token scales: each row of activations spans FP8's whole range.
        x_scale = (rows.abs().amax(dim=1, keepdim=True).to(torch.float32) / FP8_MAX).clamp(min=1e-12)
        x_fp8 = (rows.to(torch.float32) / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=scale.unsqueeze(0),
                               out_dtype=x.dtype)
        return out.reshape(*x.shape[:-1], out_features)


class Int8WeightOnly(WeightQuantization):
    name = "int8"
    storage_dtype = torch.int8

    def quantize_rows(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = weight.to(torch.float32)
        scale = (weight.abs().amax(dim=1) / INT8_MAX).clamp(min=1e-12)
        quantized = torch.round(weight / scale.unsqueeze(1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return quantized, scale

    def linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        out_features, in_features = weight.shape
        rows = x.reshape(-1, in_features).contiguous()
        if x.device.type == "cpu":
            # PyTorch's CPU kernel is fast with bf16 activations only: with float32 ones it is
            # 10-50x slower than a float32 matmul (measured on this kernel at SmolLM2's shapes),
            # with bf16 ones 2-6x faster at decode batch sizes. So a float32 model's activations
            # enter it in bf16 and the result returns in float32.
            out = torch._weight_int8pack_mm(rows.to(torch.bfloat16), weight, scale.to(torch.bfloat16))
            out = out.to(x.dtype)
        else:
            # Other devices: the int8 weight is what sits in memory; it is widened per call.
            out = F.linear(rows, weight.to(x.dtype)) * scale.to(x.dtype)
        return out.reshape(*x.shape[:-1], out_features)


METHODS: dict[str, WeightQuantization] = {
    method.name: method for method in (Fp8Quantization(), Int8WeightOnly())
}

_building_with: contextvars.ContextVar[WeightQuantization | None] = contextvars.ContextVar(
    "tokenfleet_building_with", default=None
)


def method_named(name: str | None) -> WeightQuantization | None:
    if name is None:
        return None
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown quantization {name!r}; choose one of {sorted(METHODS)}") from None


@contextlib.contextmanager
def building_with(method: WeightQuantization | None) -> Iterator[None]:
    """Linear layers created inside take `method` for their weights."""
    token = _building_with.set(method)
    try:
        yield
    finally:
        _building_with.reset(token)


def method_being_built() -> WeightQuantization | None:
    return _building_with.get()
