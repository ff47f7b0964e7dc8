"""The tiny test checkpoints load in transformers, say what we mean in config.json, and decode
with peaked logits (so greedy comparisons with transformers do not flip on rounding)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from testkit.checkpoints import TINY_ARCHS, make_tiny_checkpoint

# arch -> the config.json entries our loader reads, exactly as transformers 5 writes them.
EXPECTED_CONFIG = {
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "head_dim": 16,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    },
    "llama3_rope_scaling": {
        "model_type": "llama",
        "head_dim": 16,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "mistral": {
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "head_dim": 16,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    },
    "qwen2": {  # qkv biases are implied by the model type; no head_dim key at all
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    },
    "qwen3": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "head_dim": 32,  # not hidden_size / num_attention_heads (16)
        "attention_bias": False,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    },
    "smollm_tied": {
        "model_type": "llama",
        "head_dim": 16,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    },
}

NUM_GREEDY_STEPS = 32


def _greedy_top2_gaps(model: torch.nn.Module, seed: int) -> torch.Tensor:
    """Top-1 minus top-2 logit at each of NUM_GREEDY_STEPS greedy steps, for random prompts."""
    generator = torch.Generator().manual_seed(seed)
    gaps = []
    for prompt_len in (5, 23, 64):
        ids = torch.randint(0, model.config.vocab_size, (2, prompt_len), generator=generator)
        with torch.no_grad():
            for _ in range(NUM_GREEDY_STEPS):
                logits = model(ids).logits[:, -1].double()
                top2 = logits.topk(2, dim=-1).values
                gaps.append(top2[:, 0] - top2[:, 1])
                ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return torch.cat(gaps)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_checkpoint_loads_in_transformers_with_expected_config(
    arch: str, tmp_path: Path
) -> None:
    path = make_tiny_checkpoint(arch, tmp_path / arch)

    assert {p.name for p in path.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "generation_config.json",
    }
    config = json.loads((path / "config.json").read_text())
    for key, value in EXPECTED_CONFIG[arch].items():
        assert config[key] == value, key
    for key in ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size"):
        assert config[key] % 2 == 0, f"{key} does not split at TP=2"
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 2

    model = AutoModelForCausalLM.from_pretrained(path)
    with safe_open(path / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
        assert all(weights.get_tensor(name).dtype == torch.float32 for name in names)
    expected_names = set(model.state_dict())
    if config["tie_word_embeddings"]:
        expected_names.discard("lm_head.weight")
    assert names == expected_names


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_checkpoint_greedy_logits_are_peaked(arch: str, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(make_tiny_checkpoint(arch, tmp_path)).eval()

    gaps = _greedy_top2_gaps(model, seed=1)

    assert (gaps > 1e-2).float().mean() >= 0.95
    assert gaps.median() > 0.5


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_checkpoint_attention_changes_most_greedy_tokens(arch: str, tmp_path: Path) -> None:
    # A checkpoint whose next token hardly depends on context would pass a broken attention.
    model = AutoModelForCausalLM.from_pretrained(make_tiny_checkpoint(arch, tmp_path)).eval()
    no_attention = copy.deepcopy(model)
    for layer in no_attention.model.layers:
        layer.self_attn.o_proj.weight.data.zero_()
    ids = torch.randint(0, 512, (4, 48), generator=torch.Generator().manual_seed(2))

    with torch.no_grad():
        changed = model(ids).logits.argmax(-1) != no_attention(ids).logits.argmax(-1)

    assert changed.float().mean() > 0.5
    # ...and it does not just repeat the current token (the trap of tied embeddings).
    assert (model(ids).logits.argmax(-1) == ids).float().mean() < 0.2


def test_same_seed_writes_same_weights_and_another_seed_differs(tmp_path: Path) -> None:
    first = make_tiny_checkpoint("qwen2", tmp_path / "a", seed=7)
    again = make_tiny_checkpoint("qwen2", tmp_path / "b", seed=7)
    other = make_tiny_checkpoint("qwen2", tmp_path / "c", seed=8)

    def read(path: Path) -> dict[str, torch.Tensor]:
        with safe_open(path / "model.safetensors", "pt") as weights:
            return {name: weights.get_tensor(name) for name in weights.keys()}

    a, b, c = read(first), read(again), read(other)
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_qwen2_biases_and_qwen3_qk_norms_are_random_not_default(tmp_path: Path) -> None:
    qwen2 = make_tiny_checkpoint("qwen2", tmp_path / "qwen2")
    qwen3 = make_tiny_checkpoint("qwen3", tmp_path / "qwen3")

    with safe_open(qwen2 / "model.safetensors", "pt") as weights:
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert weights.get_tensor(f"model.layers.0.self_attn.{proj}.bias").abs().min() > 0
    with safe_open(qwen3 / "model.safetensors", "pt") as weights:
        for norm in ("q_norm", "k_norm"):
            weight = weights.get_tensor(f"model.layers.0.self_attn.{norm}.weight")
            assert weight.shape == (32,)  # per head_dim
            assert (weight - 1).abs().max() > 0.05


def test_overrides_and_tie_word_embeddings_reach_the_config(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("qwen3", tmp_path, tie_word_embeddings=True, num_hidden_layers=1)

    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    assert config["tie_word_embeddings"] is True
    with safe_open(path / "model.safetensors", "pt") as weights:
        assert "lm_head.weight" not in weights.keys()


@pytest.mark.parametrize("arch", ["llama", "llama3_rope_scaling"])
def test_legacy_rope_keys_load_to_the_same_model(arch: str, tmp_path: Path) -> None:
    current = make_tiny_checkpoint(arch, tmp_path / "v5")
    legacy = make_tiny_checkpoint(arch, tmp_path / "v4", legacy_rope_keys=True)

    config = json.loads((legacy / "config.json").read_text())
    assert "rope_parameters" not in config
    assert config["rope_theta"] == EXPECTED_CONFIG[arch]["rope_parameters"]["rope_theta"]
    assert ("rope_scaling" in config) == (arch == "llama3_rope_scaling")
    ids = torch.randint(0, 512, (2, 80), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(current)(ids).logits
        actual = AutoModelForCausalLM.from_pretrained(legacy)(ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
