"""How a linear layer stores its weight and multiplies by it: full precision, FP8 or int8.

Quantized weights keep one scale per output channel (a row of the weight), so a rank's slice
of a column-parallel layer quantizes to exactly the rows of the whole layer's quantization, and
a row-parallel rank scales its own columns. Only the linear layers of the decoder blocks are
quantized; the embedding and the LM head stay in the serving dtype, as in vLLM.

- `fp8`: weights in float8 e4m3, activations scaled per token on the fly (dynamic), the product
  through `torch._scaled_mm` (Hopper's FP8 tensor cores; PyTorch's CPU build has it too). On
  CUDA the activation quant is one Triton kernel, fused into the RMSNorm or SiLU-mul before the
  linear when the caller asks `takes_fp8_input`, and steps of few tokens may take a weight-only
  Triton kernel instead: which, per shape and token count, is measured on the GPU at start
  (workers/layers/fp8_tuning.py; the kernels are in fp8_gemm.py).
- `int8`: weight-only; activations stay in the serving dtype and `torch._weight_int8pack_mm`
  multiplies them by the int8 weight and its scales. CPU only: refused on CUDA (see below).

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

from workers.layers import fp8_gemm, fp8_tuning, triton_quant
from workers.layers.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, QuantizedActivation, quantize_activation

INT8_MAX = 127


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

    def refusal_on(self, device: torch.device) -> str | None:
        """Why this method does not run on `device` (a sentence for the user); None: it runs."""
        return None

    def register(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """A layer built with this method holds `weight` and its `scale` (its parameters)."""

    def takes_fp8_input(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `linear` wants x [num_tokens, in] already quantized (a QuantizedActivation from
        the kernel before it, which then fuses the quant) rather than in the serving dtype."""
        return False


class Fp8Quantization(WeightQuantization):
    name = "fp8"
    storage_dtype = FP8_DTYPE

    def quantize_rows(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = weight.to(torch.float32)
        scale = (weight.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
        quantized = (weight / scale.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return quantized, scale

    def register(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        fp8_tuning.register(weight, scale)  # timed with the others of its shape at start

    def takes_fp8_input(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        # x: [num_tokens, in]. Only where the product is scaled_mm or w8a8: w8a16 reads bf16.
        # `linear` asks the same measured table, so the two always agree.
        return (triton_quant.is_available(x) and fp8_gemm.is_aligned(weight)
                and not fp8_tuning.uses_w8a16(weight, x.shape[0], x.dtype))

    def linear(self, x: torch.Tensor | QuantizedActivation, weight: torch.Tensor,
               scale: torch.Tensor) -> torch.Tensor:
        out_features, in_features = weight.shape
        if isinstance(x, QuantizedActivation):  # quantized by the kernel before (takes_fp8_input)
            return self._fp8_product(x, weight, scale, fp8_tuning.choice_for(weight, x.shape[0], x.dtype))
        if not fp8_gemm.is_aligned(weight):
            return F.linear(x, self.dequantize(weight, scale, x.dtype))
        rows = x.reshape(-1, in_features)
        if not triton_quant.is_available(rows):
            # Dynamic per-token scales: each row of activations spans FP8's whole range.
            out = fp8_gemm.scaled_mm(quantize_activation(rows), weight, scale, use_fast_accum=False)
        elif (choice := fp8_tuning.choice_for(weight, rows.shape[0], rows.dtype)) and choice.path == "w8a16":
            out = fp8_gemm.w8a16(rows.contiguous(), weight, scale, choice.config)
        else:
            out = self._fp8_product(triton_quant.per_token_quant(rows.contiguous()), weight, scale, choice)
        return out.reshape(*x.shape[:-1], out_features)

    @staticmethod
    def _fp8_product(xq: QuantizedActivation, weight: torch.Tensor, scale: torch.Tensor,
                     choice: fp8_tuning.Choice | None) -> torch.Tensor:
        """e4m3 rows by the e4m3 weight: the Triton w8a8 kernel where it was measured fastest,
        else scaled_mm (above the tuned token counts, or never measured)."""
        if choice is not None and choice.path == "w8a8":
            return fp8_gemm.w8a8(xq, weight, scale, choice.w8a8_config)
        return fp8_gemm.scaled_mm(xq, weight, scale)


class Int8WeightOnly(WeightQuantization):
    name = "int8"
    storage_dtype = torch.int8

    def quantize_rows(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = weight.to(torch.float32)
        scale = (weight.abs().amax(dim=1) / INT8_MAX).clamp(min=MIN_SCALE)
        quantized = torch.round(weight / scale.unsqueeze(1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return quantized, scale

    def refusal_on(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return None
        # Widening the int8 weight to bf16 on every call reads more bytes than bf16 itself
        # (issue 31): on a GPU it would be slower than no quantization at all.
        return ("--quantization int8 (weight-only) runs on CPU only: on CUDA it has no kernel that "
                "dequantizes in registers, so it would be slower than bf16; use --quantization fp8")

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
            # Other devices but CUDA (refused there): the int8 weight is widened per call.
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
