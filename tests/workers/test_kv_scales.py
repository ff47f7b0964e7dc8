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
        shifted = float(kv_scales.measured_scale(x * 2.0**shift))
        assert shifted == float(kv_scales.measured_scale(x)) * 2.0**shift
        stored_amax = float(x.abs().amax()) * 2.0**shift / shifted
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
def test_a_malformed_checkpoint_kv_scale_is_refused_by_name(extra, message, tiny_checkpoints, tmp_path):
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


def _generate(folder, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None, **config):
    from scheduler.engine import LLMEngine

    config = {"model": str(folder), "dtype": "float32", "block_size": 16, "num_kv_blocks": 256,
              "max_num_seqs": 8, **config}
    with LLMEngine(EngineConfig(**config)) as engine:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
        return engine.generate(prompts, params)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graphs)")
def test_cuda_graphs_replay_the_scales_measured_after_their_capture(tiny_checkpoints, tmp_path):
    """The graphs are captured at start, before the first real step measures the scales; they
    read the scales from device memory, so decodes replayed from a graph use the measured ones:
    the rescaled model's tokens are the original's (with 1.0 baked in they would saturate).
    float32: its products are IEEE ones, exact under the power-of-two rescaling (bf16 steps
    widen an FP8 cache's tiles to float16, where q / 1,024 loses its smallest elements)."""
    folder = tiny_checkpoints["llama"]
    rescaled = rescaled_kv_checkpoint(folder, tmp_path / "rescaled", FACTOR)
    prompts = [PROMPT, PROMPT[:9], PROMPT[5:30]]
    from scheduler.engine import LLMEngine

    outputs = []
    for model in (folder, rescaled):
        config = EngineConfig(model=str(model), device="cuda", dtype="float32", kv_cache_dtype="fp8",
                              num_kv_blocks=256, max_num_seqs=4)
        with LLMEngine(config) as engine:
            runner = engine.executor.runner
            assert runner.decode_graphs is not None and runner.kv_scale_measurement.is_pending
            greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
            results = engine.generate(prompts, greedy)
            assert not runner.kv_scale_measurement.is_pending
        outputs.append([r.token_ids for r in results])
    assert outputs[0] == outputs[1]


CHATS = ["What is the capital of France?", "What is 2 + 2?", "Name the largest planet in the solar system.",
         "Who wrote Romeo and Juliet?", "What color is the sky on a clear day?"]
NEAR_TIE = 0.5  # nats, as tests/scheduler/test_kv_fp8_engine.py's SmolLM2 test bounds it


def _chat_prompts(folder) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = []
    for question in CHATS:
        messages = [{"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return prompts


@pytest.mark.slow
def test_smollm2_chats_with_fp8_weights_and_cache_do_not_depend_on_the_kv_range(smollm2, tmp_path) -> None:
    """Real weights, FP8 weights and an FP8 KV cache, five chats x 24 greedy tokens. SmolLM2 with
    K and V 64x larger (|K| up to ~1,300, as large as Qwen2's keys get) must answer token for
    token as SmolLM2 does: under unit scales its keys saturated at 448 and every answer was
    nonsense. And wherever the answers part from a full-precision model's, the FP8 pair chose a
    token within NEAR_TIE nats of the full-precision best (the France question's first token is
    such a tie: "The" leads "L" by 0.08 nats in float32, so any FP8 rounding may flip it)."""
    prompts = _chat_prompts(smollm2)
    fp8 = {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    answers = _generate(smollm2, prompts, 24, **fp8)
    rescaled = rescaled_kv_checkpoint(smollm2, tmp_path / "smollm2_kv_x64", 64.0)
    assert [r.token_ids for r in _generate(rescaled, prompts, 24, **fp8)] == [r.token_ids for r in answers]
    full = _generate(smollm2, prompts, 24, logprobs=5)
    for exact, quantized in zip(full, answers, strict=True):
        pairs = zip(exact.token_ids, quantized.token_ids, strict=True)
        where = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        if where is None:
            continue
        top = exact.logprobs[where].top_logprobs
        chosen = dict(top).get(quantized.token_ids[where])
        assert chosen is not None and top[0][1] - chosen <= NEAR_TIE, (where, top, quantized.token_ids)
