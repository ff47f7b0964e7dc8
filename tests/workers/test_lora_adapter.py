"""A PEFT adapter folder read and checked against the base: every refusal names the file and
the problem (shared/lora_config.py, workers/lora/adapter.py)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.errors import LoraAdapterError
from shared.lora_config import read_lora_config
from shared.model_config import load_model_config
from workers.lora.adapter import load_adapter


@pytest.fixture
def adapter_copy(lora_adapters, tmp_path) -> Path:
    """A copy of the rank-8 adapter (k, o, gate) that a test may break."""
    return Path(shutil.copytree(lora_adapters["rank8-ko-gate"], tmp_path / "adapter"))


def _read(folder: Path, base: Path, max_lora_rank: int = 16):
    return read_lora_config(str(folder), load_model_config(base), base_path=str(base),
                            max_lora_rank=max_lora_rank)


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_a_peft_adapter_reads_with_its_scaling_and_targets(adapter_copy, tiny_checkpoints) -> None:
    base = tiny_checkpoints["llama"]
    config = _read(adapter_copy, base)
    assert (config.rank, config.scaling) == (8, 2.0)  # lora_alpha 16 / r 8
    assert config.target_modules == ("k_proj", "o_proj", "gate_proj")
    adapter = load_adapter("x", config, load_model_config(base))
    weights = adapter.pairs()
    assert sorted({module for _, module in weights}) == ["gate_proj", "k_proj", "o_proj"]
    assert len(weights) == 3 * 4  # every layer of the 4
    file = load_file(adapter_copy / "adapter_model.safetensors")
    a, b = weights[(2, "o_proj")]
    assert torch.equal(a, file["base_model.model.model.layers.2.self_attn.o_proj.lora_A.weight"])
    assert torch.equal(b, file["base_model.model.model.layers.2.self_attn.o_proj.lora_B.weight"])
    assert adapter.scaling == 2.0  # applied as B goes into a slot
    _edit_config(adapter_copy, use_rslora=True)
    assert _read(adapter_copy, base).scaling == pytest.approx(16 / math.sqrt(8))


@pytest.mark.parametrize(("change", "problem"), [
    ({"r": 32}, "rank 32 is over max_lora_rank=16"),
    ({"target_modules": ["k_proj", "lm_head"]}, "target module 'lm_head' is not one this base has"),
    ({"base_model_name_or_path": "meta-llama/Llama-3-8B"}, "made for base 'meta-llama/Llama-3-8B'"),
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'; only LORA adapters are served"),
])
def test_a_config_the_base_cannot_serve_is_refused_naming_the_file(adapter_copy, tiny_checkpoints,
                                                                   change, problem) -> None:
    _edit_config(adapter_copy, **change)
    with pytest.raises(LoraAdapterError, match="adapter_config.json: " + problem.replace("(", r"\(")) as err:
        _read(adapter_copy, tiny_checkpoints["llama"])
    assert str(adapter_copy) in err.value.message and err.value.http_status == 400


def test_missing_and_corrupt_files_are_refused_naming_them(adapter_copy, tiny_checkpoints, tmp_path) -> None:
    base = tiny_checkpoints["llama"]
    with pytest.raises(LoraAdapterError, match="nowhere: no such folder"):
        _read(tmp_path / "nowhere", base)
    weights = adapter_copy / "adapter_model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-10])  # cut short: its last tensor lies past the end
    config = _read(adapter_copy, base)
    with pytest.raises(LoraAdapterError, match="unreadable safetensors \\(tensor '.*' lies outside the file"):
        load_adapter("x", config, load_model_config(base))
    weights.write_bytes(whole[:8] + b"{not json" + whole[17:])
    with pytest.raises(LoraAdapterError, match="unreadable safetensors \\(its header is not JSON"):
        load_adapter("x", config, load_model_config(base))
    weights.write_bytes(b"\x00garbage")
    with pytest.raises(LoraAdapterError, match="adapter_model.safetensors: unreadable safetensors"):
        load_adapter("x", config, load_model_config(base))
    (adapter_copy / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraAdapterError, match="adapter_model.safetensors: missing"):
        _read(adapter_copy, base)
    (adapter_copy / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraAdapterError, match="adapter_config.json: unreadable"):
        _read(adapter_copy, base)


def test_an_adapter_of_another_shape_is_refused_naming_the_tensor(adapter_copy, tiny_checkpoints) -> None:
    """Trained on a base of other widths (the stated base left out): the shapes say so."""
    base = tiny_checkpoints["llama"]
    _edit_config(adapter_copy, base_model_name_or_path=None)
    path = adapter_copy / "adapter_model.safetensors"
    tensors = load_file(path)
    name = "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"
    tensors[name] = torch.zeros(8, 96)
    save_file(tensors, path)
    problem = f"tensor '{name}' has shape \\(8, 96\\), expected \\(8, 64\\)"
    with pytest.raises(LoraAdapterError, match=problem):
        load_adapter("x", _read(adapter_copy, base), load_model_config(base))
