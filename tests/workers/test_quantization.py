"""Quantized linear weights (fp8, int8): the arithmetic, the loading, the sizing, the quality."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shared.config import EngineConfig
from shared.errors import ModelLoadError
from shared.sampling import SamplingParams
from shared.step import SequenceWork, StepBatch
from testkit.checkpoints import make_tiny_checkpoint
from workers.layers.linear import LinearBase
from workers.layers.quantization import FP8_DTYPE, METHODS
from workers.model_runner import ModelRunner
from workers.parallel import SINGLE_DEVICE

GREEDY = SamplingParams(temperature=0.0)


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).norm() / ref.float().norm())


def _runner(folder, **config) -> ModelRunner:
    config.setdefault("dtype", "float32")
    return ModelRunner(EngineConfig(model=str(folder), num_kv_blocks=16, block_size=8, **config),
                       SINGLE_DEVICE)


def _last_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    blocks = list(range(-(-len(prompt) // runner.block_size)))
    batch = StepBatch(0, [SequenceWork("r", prompt, 0, blocks, True, GREEDY)])
    return runner.forward(batch, use_graphs=False)[0].float()


@pytest.mark.parametrize(("name", "bound"), [("int8", 0.02), ("fp8", 0.07)])
def test_rows_quantize_and_dequantize_close_to_the_weight(name: str, bound: float) -> None:
    method = METHODS[name]
    row_sizes = torch.linspace(0.01, 3.0, 96).unsqueeze(1)  # rows of every size
    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(0)) * row_sizes
    quantized, scale = method.quantize_rows(weight)
    assert quantized.dtype == method.storage_dtype and scale.shape == (96,)
    restored = method.dequantize(quantized, scale, torch.float32)
    row_errors = (restored - weight).norm(dim=1) / weight.norm(dim=1)
    assert float(row_errors.max()) < bound  # one scale per row: a small row is as exact as a big one


@pytest.mark.parametrize(("name", "bound"), [("int8", 1e-2), ("fp8", 1e-5)])
def test_quantized_linear_is_the_product_with_its_dequantized_weight(name: str, bound: float) -> None:
    """int8 on CPU multiplies in bf16 (its fast kernel's dtype): the bound is bf16's rounding."""
    method = METHODS[name]
    weight, x = torch.randn(48, 64), torch.randn(5, 64)
    quantized, scale = method.quantize_rows(weight)
    ours = method.linear(x, quantized, scale)
    dequantized = method.dequantize(quantized, scale, torch.float32)
    if name == "fp8":  # activations pass through FP8 too, one scale per token
        x_scale = x.abs().amax(dim=1, keepdim=True) / torch.finfo(FP8_DTYPE).max
        x = (x / x_scale).to(FP8_DTYPE).float() * x_scale
    assert _relative_error(ours, F.linear(x, dequantized)) < bound


@pytest.mark.parametrize(("name", "bound"), [("int8", 0.03), ("fp8", 0.15)])
def test_a_quantized_model_tracks_float32_and_holds_its_linear_weights_in_one_byte(
    name: str, bound: float, tiny_checkpoints
) -> None:
    folder = tiny_checkpoints["llama"]
    rng = random.Random(name)
    prompt = [rng.randrange(3, 512) for _ in range(29)]
    full, quantized = _runner(folder), _runner(folder, quantization=name)
    assert _relative_error(_last_logits(quantized, prompt), _last_logits(full, prompt)) < bound
    linears = [m for m in quantized.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.element_size() == 1 for m in linears)
    linear_params = sum(m.weight.numel() for m in linears)
    # Each linear weight went from 4 bytes to 1, plus a float32 scale per row.
    saved = full.weight_bytes - quantized.weight_bytes
    assert saved == 3 * linear_params - 4 * sum(m.weight_scale.numel() for m in linears)


def test_a_budget_that_refuses_bf16_loads_fp8(tmp_path: Path) -> None:
    """The seed's scenario in small: the linear layers dominate, as in Llama-3-8B, and a rank
    may hold 60% of the bf16 weights."""
    folder = make_tiny_checkpoint("llama", tmp_path / "m", hidden_size=128, intermediate_size=512,
                                  vocab_size=128, num_hidden_layers=2)
    bf16_bytes = _runner(folder, dtype="bfloat16").weight_bytes
    budget = int(0.6 * bf16_bytes)
    with pytest.raises(ModelLoadError, match="do not fit"):
        _runner(folder, dtype="bfloat16", max_weight_bytes_per_rank=budget)
    fp8 = _runner(folder, dtype="bfloat16", quantization="fp8", max_weight_bytes_per_rank=budget)
    assert fp8.weight_bytes <= budget


def _write_compressed_tensors_fp8(source: Path, out: Path) -> Path:
    """An FP8_DYNAMIC checkpoint written by compressed-tensors' own save path (what
    llm-compressor does, with the channel scales it would observe)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    fp8_max = torch.finfo(FP8_DTYPE).max
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            channel_max = module.weight.detach().abs().amax(dim=1, keepdim=True)
            module.weight_scale.data.copy_(channel_max / fp8_max)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    return out


def test_a_compressed_tensors_fp8_checkpoint_loads_as_stored(tiny_checkpoints, tmp_path: Path) -> None:
    source = tiny_checkpoints["llama"]
    folder = _write_compressed_tensors_fp8(source, tmp_path / "fp8")
    stored = _runner(folder)  # no flag: the checkpoint says fp8
    assert stored.quantization == "fp8"
    online = _runner(source, quantization="fp8")  # the same scales, computed at load
    assert stored.weight_bytes == online.weight_bytes
    prompt = list(range(5, 300, 7))
    assert _relative_error(_last_logits(stored, prompt), _last_logits(online, prompt)) < 1e-3
    with pytest.raises(ModelLoadError, match="stores fp8 weights; it cannot run as int8"):
        _runner(folder, quantization="int8")


def test_checkpoint_quantizations_we_cannot_run_are_refused_by_name(tiny_checkpoints, tmp_path: Path) -> None:
    folder = make_tiny_checkpoint("llama", tmp_path / "gptq", num_hidden_layers=1)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    config_path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="'gptq' is not supported"):
        _runner(folder)
    with pytest.raises(ModelLoadError, match="unknown quantization 'int4'"):
        _runner(tiny_checkpoints["llama"], quantization="int4")


def test_int8_is_refused_on_cuda_with_a_message_naming_the_flag(tiny_checkpoints) -> None:
    """Widening int8 weights to bf16 per call is slower than bf16 on a GPU: refused there, not run."""
    from shared.model_config import load_model_config
    from workers.model_runner import resolve_quantization

    model_config = load_model_config(str(tiny_checkpoints["llama"]))
    message = "--quantization int8 .* runs on CPU only.*use --quantization fp8"
    with pytest.raises(ModelLoadError, match=message):
        resolve_quantization("int8", model_config, torch.device("cuda", 0))
    assert resolve_quantization("int8", model_config, torch.device("cpu")) == "int8"
    assert resolve_quantization("fp8", model_config, torch.device("cuda", 0)) == "fp8"
