"""The Qwen-14B stand-in the GPU benchmarks serve (testkit/qwen_checkpoints.py), checked on this
CPU: its builder on a tiny shape with the real vocabulary, and the real shape's weight bytes
against a 24 GB per-rank budget (bf16 refused before any weight is allocated; fp8 and TP=2 fit)."""

from __future__ import annotations

import json

import pytest
import torch

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.errors import ModelLoadError
from shared.model_config import load_model_config
from shared.sampling import SamplingParams
from shared.tokenizer import load_tokenizer
from testkit.qwen_checkpoints import QWEN_14B, make_qwen_checkpoint, qwen_config, qwen_num_params
from workers.layers.quantization import building_with, method_named
from workers.model_runner import ModelRunner
from workers.models.registry import MODEL_CLASSES
from workers.parallel import SINGLE_DEVICE, TensorParallel
from workers.weight_loader import resident_weight_bytes

BUDGET = 24e9


def test_the_14b_builder_on_a_tiny_shape_with_the_real_vocabulary(tmp_path) -> None:
    shape = {**QWEN_14B, "hidden_size": 64, "num_attention_heads": 4, "kv_channels": 16,
             "num_hidden_layers": 3, "intermediate_size": 256}
    folder = make_qwen_checkpoint(tmp_path / "q", shape, dtype="bfloat16", std=0.02, layers_per_file=2)
    assert len(list(folder.glob("*.safetensors"))) == 2
    assert json.loads((folder / "config.json").read_text())["bf16"] is True
    cfg = load_model_config(folder)
    assert (cfg.vocab_size, cfg.seq_length, cfg.max_position_embeddings) == (152064, 2048, 8192)
    tokenizer = load_tokenizer(folder)
    assert len(tokenizer) == 151643 + 208 and tokenizer.eos_token_id == 151643
    # The bench's prompt words are a token each, with their space, as with the real vocabulary.
    assert len(tokenizer.encode_plain(" time person year world")) == 4
    config = EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=32, block_size=16)
    with LLMEngine(config) as engine:
        [result] = engine.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=4,
                                                                   ignore_eos=True), chat=True)
    assert len(result.token_ids) == 4
    tokenizer.decode(result.token_ids)  # ids of padding rows included: decodes to text, no error


def _meta_weight_bytes(cfg, quantization: str | None, tp=SINGLE_DEVICE) -> int:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"), building_with(method_named(quantization)):
            return resident_weight_bytes(MODEL_CLASSES["qwen"](cfg, tp, 8192))
    finally:
        torch.set_default_dtype(previous)


def test_qwen14b_in_bf16_is_refused_under_24e9_per_rank_and_fp8_or_tp2_fit(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(qwen_config(QWEN_14B)))
    cfg = load_model_config(tmp_path)
    bf16 = _meta_weight_bytes(cfg, None)
    kv_scale_bytes = 2 * 4 * cfg.num_layers  # each layer's K and V scale of an FP8 cache, float32
    assert bf16 == 2 * qwen_num_params(QWEN_14B) + kv_scale_bytes and 28e9 < bf16 < 29e9  # the seed's 28 GB
    assert _meta_weight_bytes(cfg, "fp8") < 17e9  # the linears' weights in one byte
    assert _meta_weight_bytes(cfg, None, TensorParallel(rank=0, size=2)) < 15e9
    with pytest.raises(ModelLoadError, match=r"do not fit: rank 0 of tp=1 needs 28\.\d+ GB.*tp=2") as info:
        ModelRunner(EngineConfig(model=str(tmp_path), device="cpu", dtype="bfloat16",
                                 max_weight_bytes_per_rank=int(BUDGET)), SINGLE_DEVICE)
    assert "\n" not in str(info.value)
