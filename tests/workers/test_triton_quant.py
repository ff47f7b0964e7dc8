"""The FP8 Triton kernels against their PyTorch references: the per-token activation quant
(alone and fused into RMSNorm and SiLU-mul) and the small-M weight-only product (fp8 and int8
weights; GEMV and tl.dot forms, with and without split-K). On CUDA, and in Triton's interpreter
on CPU hosts (float32 there: its bf16 casts truncate, and its float32 -> e4m3 cast loses the
carry when a value rounds up to the next power of two: -127.6 becomes -64, not -128. Those values
are told apart from real errors by that exact signature; scales, being float32 maxima, agree
exactly). Products are held to the rounding bound of their arithmetic (product_error)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.workers.triton_interpreter import run_interpreted
from workers.layers import fp8_gemm, triton_quant
from workers.layers.fp8 import FP8_DTYPE, QuantizedActivation, quantize_activation
from workers.layers.fp8_gemm import W8A16Config
from workers.layers.norm import RMSNorm
from workers.layers.quantization import METHODS


def e4m3_steps_apart(ours: torch.Tensor, ref: torch.Tensor, *, interpreted: bool) -> float:
    """The largest gap between two e4m3 tensors, in e4m3 steps at the reference's magnitude."""
    a, b = ours.float().cpu(), ref.float().cpu()
    if interpreted:  # the interpreter's lost carry (module docstring): x.5 * 2^e rounding to 2^(e+1)
        lost_carry = (b != 0) & (a * 2 == b) & (torch.log2(b.abs()) == torch.log2(b.abs()).round())
        assert float(lost_carry.float().mean()) < 0.1
        a = torch.where(lost_carry, b, a)
    exponent = torch.floor(torch.log2(b.abs().clamp(min=2.0**-6)))  # subnormals share 2^-6's step
    return float(((a - b).abs() / 2.0 ** (exponent - 3)).max())


def kernels_vs_pytorch(dtype: torch.dtype, device: str) -> dict[str, float]:
    """name -> error: e4m3 steps for the quants, relative error for the scales and products."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    errors: dict[str, float] = {}

    def compare(name: str, ours: QuantizedActivation, ref: QuantizedActivation) -> None:
        assert ours.data.dtype == FP8_DTYPE and ours.scale.shape == (ref.data.shape[0], 1)
        errors[f"{name} values"] = e4m3_steps_apart(ours.data, ref.data, interpreted=device == "cpu")
        errors[f"{name} scales"] = float(((ours.scale - ref.scale).abs() / ref.scale).max())

    x = randn(7, 96) * torch.linspace(0.01, 5, 7, device=device, dtype=dtype)[:, None]  # rows of every size
    x[3] = 0  # an all-zero row keeps a finite scale
    compare("per_token", triton_quant.per_token_quant(x), quantize_activation(x))

    residual = randn(7, 96)
    norm = RMSNorm(96, 1e-5).to(device)
    norm.weight.data = randn(96)
    ours, res_out = triton_quant.rms_norm_quant(x, norm.weight, 1e-5, residual)
    compare("rms_norm", ours, quantize_activation(norm._norm(x + residual)))
    errors["rms_norm residual"] = float((res_out - (x + residual)).abs().max())
    ours, none = triton_quant.rms_norm_quant(x, norm.weight, 1e-5)
    assert none is None
    compare("rms_norm, no residual", ours, quantize_activation(norm._norm(x)))

    gate_up = randn(5, 2 * 80)
    gate, up = gate_up.chunk(2, dim=-1)
    compare("silu_and_mul", triton_quant.silu_and_mul_quant(gate_up), quantize_activation(F.silu(gate) * up))

    # The fp8 linear fed the norm's fused quant multiplies exactly those e4m3 rows and scales.
    fp8 = METHODS["fp8"]
    weight, scale = fp8.quantize_rows(torch.randn(64, 96, generator=gen))
    weight, scale = weight.to(device), scale.to(device)
    fed, _ = triton_quant.rms_norm_quant(x, norm.weight, 1e-5, residual)
    errors["fp8 linear of the fused quant"] = product_error(
        fp8.linear(fed, weight, scale), fed.data.float() * fed.scale,
        fp8.dequantize(weight, scale, torch.float32), fast_accum=device == "cuda")

    for name in ("fp8", "int8"):
        method = METHODS[name]
        weight, scale = method.quantize_rows(torch.randn(200, 384, generator=gen))
        weight, scale = weight.to(device), scale.to(device)
        # On CUDA also every config the tuner may choose for M = 1 (each is its own compile).
        tuned = tuple((1, c) for c in fp8_gemm.configs_for(1)) if device == "cuda" else ()
        cases = SMALL_M_CASES + tuned
        for m, config in cases:
            rows = randn(m, 384)
            ours = fp8_gemm.w8a16(rows, weight, scale, config)
            assert ours.dtype == dtype and ours.shape == (m, 200)
            label = config.label() if config else "default"
            errors[f"w8a16 {name} M={m} {label}"] = product_error(
                ours, rows, method.dequantize(weight, scale, torch.float32))
    return errors


# (M, config) of the small-M kernel: both forms, split-K or not, K (384) a multiple of BLOCK_K or
# not, N (200) never a multiple of BLOCK_N.
SMALL_M_CASES = (
    (1, W8A16Config(16, 128, 4, 1, 1, gemv=True)), (1, W8A16Config(32, 256, 4, 1, 2, gemv=True)),
    (1, W8A16Config(16, 128, 4, 2)), (3, W8A16Config(32, 128, 4, 2, 2)), (16, W8A16Config(64, 256, 4, 2)),
    (40, None), (70, W8A16Config(64, 64, 4, 2, 3)),
    (3, W8A16Config(32, 64, 4, 2, 4)),  # 6 K tiles over 4 splits: the last has none, writes zeros
)


def product_error(ours: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *,
                  fast_accum: bool = False) -> float:
    """How far ours is from x @ weight.T (in float64), as a share of the error bound of a float32
    product: each output summed over K terms, every partial sum rounded, has
    |error| <= K * u * sum_k |x_k w_k| (Higham's gamma_K bound; u = 2^-24 for float32), plus one
    rounding of the output to its dtype (2^-24 or bf16's 2^-8). A value <= 1 is within the bound.
    Hopper's FP8 tensor cores with fast accumulation (`_scaled_mm`'s use_fast_accum) keep about
    14 bits of the running sum, not 24 (DeepSeek-V3 report, section 3.3.2): u = 2^-13 there. That
    is why the float32 test once failed at 1.66e-4 against a flat 1e-5."""
    x64, w64 = x.double().cpu(), weight.double().cpu()
    ref = x64 @ w64.T
    magnitude = x64.abs() @ w64.abs().T
    accumulate = 2.0**-13 if fast_accum else 2.0**-24
    output = 2.0**-24 if ours.dtype == torch.float32 else 2.0**-8
    bound = (x.shape[1] + 2) * accumulate * magnitude + output * ref.abs() + 1e-30
    return float(((ours.double().cpu() - ref).abs() / bound).max())


def check(errors: dict[str, float], scale_bound: float) -> None:
    for name, error in errors.items():
        if name.endswith("values"):
            assert error <= 1.0, (name, errors)  # at most one e4m3 step
        elif name.endswith("scales") or name.endswith("residual"):
            assert error <= scale_bound, (name, errors)
        else:
            assert error <= 1.0, (name, errors)  # within the product's rounding bound (product_error)


@pytest.mark.skipif(not torch.cuda.is_available() or triton_quant.triton is None,
                    reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kernels_match_pytorch_on_cuda(dtype) -> None:
    errors = kernels_vs_pytorch(dtype, "cuda")
    # bf16: RMSNorm's float32 sum is reduced in another order (one bf16 step of the normed row,
    # so at most one e4m3 step after the cast). Products: product_error's bound.
    check(errors, scale_bound=1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.skipif(triton_quant.triton is None, reason="needs Triton installed")
def test_the_small_m_kernel_does_not_specialise_on_the_token_count() -> None:
    params = {p.name: p.do_not_specialize for p in fp8_gemm._w8a16_kernel.params}
    assert params["M"]


_INTERPRETER_CHECK = """
import torch
from tests.workers.test_triton_quant import check, kernels_vs_pytorch
check(kernels_vs_pytorch(torch.float32, "cpu"), scale_bound=1e-6)
print("ok")
"""


@pytest.mark.skipif(triton_quant.triton is None or torch.cuda.is_available(),
                    reason="needs Triton installed; on CUDA hosts the compiled kernels are tested instead")
def test_fp8_kernels_match_pytorch_in_the_interpreter() -> None:
    run_interpreted(_INTERPRETER_CHECK)
