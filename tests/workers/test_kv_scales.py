"""An FP8 KV cache's per-layer K and V scales: read from a checkpoint that has them, measured in
the first real step where it has none, and what they are for: a model whose K/V reach past
e4m3's +-448 (made here by rescaling a checkpoint's K and V, kv_rescaled.py) reads its cache as
well as the same model at its original range does."""

from __future__ import annotations

import pytest
import torch

from shared.config import EngineConfig
from shared.errors import ModelLoadError
from shared.sampling import SamplingParams
from shared.step import SequenceWork, StepBatch
from tests.workers.kv_rescaled import rescaled_kv_checkpoint
from tests.workers.test_kv_fp8 import _logits_of_steps
from workers.layers import kv_scales
from workers.layers.fp8 import FP8_MAX
from workers.model_runner import ModelRunner
from workers.parallel import SINGLE_DEVICE

FACTOR = 2.0**10  # the tiny models' |K| of a few units -> thousands, past e4m3's 448
PROMPT = [(7 * i + 3) % 500 + 3 for i in range(37)]
NEXT_IDS = [11, 400, 23, 5]


def _runner(folder, **config) -> ModelRunner:
    config = {"dtype": "float32", "num_kv_blocks": 32, "block_size": 4, "kv_cache_dtype": "fp8",
              "device": "cpu", **config}
    return ModelRunner(EngineConfig(model=str(folder), **config), SINGLE_DEVICE)


def _attention_layers(runner: ModelRunner) -> list:
    return [m for m in runner.model.modules() if hasattr(m, "kv_scale_source")]


def _scales(runner: ModelRunner) -> list[tuple[float, float]]:
    return [(float(a.k_scale), float(a.v_scale)) for a in _attention_layers(runner)]


def test_a_measured_scale_is_the_power_of_two_that_leaves_headroom() -> None:
    target = FP8_MAX / kv_scales.HEADROOM  # 112
    assert float(kv_scales.measured_scale(torch.tensor([20.0, -3.0]))) == 0.25  # 20 / 0.25 = 80
    assert float(kv_scales.measured_scale(torch.tensor([-target]))) == 1.0  # exactly at the target
    assert float(kv_scales.measured_scale(torch.tensor([target * 1.01]))) == 2.0
    assert float(kv_scales.measured_scale(torch.zeros(4))) == kv_scales.MIN_MEASURED_SCALE
    x = torch.randn(64, 3, 8) * 37
    for shift in (-12, 3, 10):
        assert float(kv_scales.measured_scale(x * 2.0**shift)) == float(kv_scales.measured_scale(x)) * 2.0**shift
        stored_amax = float(x.abs().amax() * 2.0**shift / kv_scales.measured_scale(x * 2.0**shift))
        assert target / 2 < stored_amax <= target


@pytest.mark.parametrize(("name", "targets"), [
    ("model.layers.3.self_attn.k_scale", ("model.layers.3.self_attn.attn.k_scale",)),
    ("model.layers.3.self_attn.v_proj.output_scale", ("model.layers.3.self_attn.attn.v_scale",)),
    ("model.layers.0.self_attn.k_proj.k_scale", ("model.layers.0.self_attn.attn.k_scale",)),
    ("model.layers.1.self_attn.kv_scale", ("model.layers.1.self_attn.attn.k_scale",
                                           "model.layers.1.self_attn.attn.v_scale")),
    ("model.layers.1.self_attn.k_proj.weight_scale", None),
])
def test_checkpoint_kv_scale_names_fill_the_attention_layers_scales(name, targets) -> None:
    assert kv_scales.checkpoint_targets(name) == targets


def test_the_first_step_measures_each_layers_scales_and_later_steps_keep_them(tiny_checkpoints) -> None:
    runner = _runner(tiny_checkpoints["llama"])
    assert runner.kv_scale_measurement.is_pending and set(_scales(runner)) == {(1.0, 1.0)}
    _logits_of_steps(runner, PROMPT, NEXT_IDS[:1])  # the first chunk measures; the rest reuse
    first = _scales(runner)
    assert not runner.kv_scale_measurement.is_pending
    assert all(a.kv_scale_source == "measured" for a in _attention_layers(runner))
    for layer, (k_scale, v_scale) in enumerate(first):
        # The stored e4m3 values reach at most 112 (headroom up to 448) and more than half that.
        k_cache, v_cache = runner.kv_caches[layer, 0].float(), runner.kv_caches[layer, 1].float()
        assert FP8_MAX / 8 <= float(k_cache.abs().max()) <= FP8_MAX / 4
        assert float(v_cache.abs().max()) <= FP8_MAX / 4
        assert k_scale != 1.0 and v_scale != 1.0  # powers of two, measured
    work = SequenceWork("s", [3, 4, 5, 6, 7, 8], 0, [20, 21], True, SamplingParams(temperature=0.0))
    runner.forward(StepBatch(9, [work]), use_graphs=False)
    assert _scales(runner) == first


def test_calculate_kv_scales_off_keeps_unit_scales_without_checkpoint_scales(tiny_checkpoints) -> None:
    runner = _runner(tiny_checkpoints["llama"], calculate_kv_scales=False)
    assert not runner.kv_scale_measurement.is_pending
    _logits_of_steps(runner, PROMPT, NEXT_IDS[:1])
    assert set(_scales(runner)) == {(1.0, 1.0)}


def _layer_names(folder, num_layers: int = 2) -> list[str]:
    return [f"model.layers.{i}" for i in range(num_layers)]


def test_scales_from_a_checkpoint_are_used_as_stored(tiny_checkpoints, tmp_path) -> None:
    """One layer in compressed-tensors' naming (k_proj/v_proj output_scale), one in AutoFP8's
    single kv_scale; the cache then stores value / scale, and no step re-measures them."""
    folder = tiny_checkpoints["llama"]
    num_layers = len(_attention_layers(_runner(folder, kv_cache_dtype="auto")))
    extra = {}
    for i in range(num_layers):
        if i % 2 == 0:
            extra[f"model.layers.{i}.self_attn.k_proj.output_scale"] = torch.tensor([0.0625])
            extra[f"model.layers.{i}.self_attn.v_proj.output_scale"] = torch.tensor([0.125])
        else:
            extra[f"model.layers.{i}.self_attn.kv_scale"] = torch.tensor(0.5, dtype=torch.bfloat16)
    extra["model.layers.0.self_attn.q_scale"] = torch.tensor(3.0)  # FP8 attention math: not ours, skipped
    with_scales = rescaled_kv_checkpoint(folder, tmp_path / "with_scales", 1.0, extra)
    runner = _runner(with_scales)
    expected = [(0.0625, 0.125) if i % 2 == 0 else (0.5, 0.5) for i in range(num_layers)]
    assert _scales(runner) == expected and not runner.kv_scale_measurement.is_pending
    _logits_of_steps(runner, PROMPT, NEXT_IDS[:1])
    assert _scales(runner) == expected
    # --calculate-kv-scales on measures them anyway.
    measured = _runner(with_scales, calculate_kv_scales=True)
    assert measured.kv_scale_measurement.is_pending
    _logits_of_steps(measured, PROMPT, NEXT_IDS[:1])
    assert _scales(measured) != expected


@pytest.mark.parametrize(("extra", "message"), [
    ({"model.layers.0.self_attn.k_scale": torch.tensor([0.5, 0.5])}, "one number per layer"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)}, "positive and finite"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor(0.5)}, r"\['k_scale'\] for model.layers.0"),
])
def test_a_malformed_checkpoint_kv_scale_is_refused_by_name(extra, message, tiny_checkpoints, tmp_path) -> None:
    folder = rescaled_kv_checkpoint(tiny_checkpoints["llama"], tmp_path / "bad", 1.0, extra)
    with pytest.raises(ModelLoadError, match=message):
        _runner(folder)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_fp8_cache_reads_kv_past_e4m3s_range_as_it_reads_the_same_model_in_range(
        arch: str, tiny_checkpoints, tmp_path) -> None:
    """The rescaled model computes the original's function with K/V 1,024x larger (thousands,
    where e4m3 saturates at 448). Measured scales are powers of two 1,024x larger too, so the
    cache holds the very same e4m3 bytes and the logits are the original's, to the bit. A unit
    scale saturated them (the logits moved by a third and more)."""
    folder = tiny_checkpoints[arch]
    rescaled = rescaled_kv_checkpoint(folder, tmp_path / "rescaled", FACTOR)
    full = _logits_of_steps(_runner(folder, kv_cache_dtype="auto"), PROMPT, NEXT_IDS)
    full_rescaled = _logits_of_steps(_runner(rescaled, kv_cache_dtype="auto"), PROMPT, NEXT_IDS)
    for a, b in zip(full_rescaled, full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # the same function
    fp8 = _logits_of_steps(_runner(folder), PROMPT, NEXT_IDS)
    fp8_rescaled_runner = _runner(rescaled)
    fp8_rescaled = _logits_of_steps(fp8_rescaled_runner, PROMPT, NEXT_IDS)
    assert float(fp8_rescaled_runner.kv_caches.float().abs().max()) < FP8_MAX  # nothing saturated
    for a, b in zip(fp8_rescaled, fp8, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_checkpoint_scales_that_match_the_range_read_as_unit_scales_do_in_range(tiny_checkpoints, tmp_path):
    """Calibrated scales (here 1,024 for K and V of the 1,024x model, measuring off) give the
    logits that unit scales give the original model."""
    folder = tiny_checkpoints["llama"]
    num_layers = len(_attention_layers(_runner(folder, kv_cache_dtype="auto")))
    extra = {f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(FACTOR)
             for i in range(num_layers) for kind in "kv"}
    rescaled = rescaled_kv_checkpoint(folder, tmp_path / "calibrated", FACTOR, extra)
    unit = _logits_of_steps(_runner(folder, calculate_kv_scales=False), PROMPT, NEXT_IDS)
    calibrated = _logits_of_steps(_runner(rescaled, calculate_kv_scales=False), PROMPT, NEXT_IDS)
    for a, b in zip(calibrated, unit, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
