"""Tiny random-weight Hugging Face checkpoints of every architecture we serve, made on the fly.

It serves the tests (tests/conftest.py builds one of each per session, and correctness is
judged against transformers on the very same weights) and the benchmarks under scripts/ (a
model that costs little, so what is measured is the path around it); the fleet itself never
calls it. Nothing is downloaded: only transformers' config and model classes are used.

Each arch in TINY_ARCHS becomes a folder (config.json, model.safetensors, generation_config.json;
no tokenizer) that transformers loads with plain `from_pretrained`, so a test can judge our
model against the transformers implementation of the very same weights.

The weights are random but not transformers' default init: embeddings and lm_head are drawn
with std 1.0, which makes the next-token logits peaked (top-2 gaps of order 1, not 1e-4), so
greedy decoding does not flip between near-tied tokens on float rounding; the other matrices
use std 0.1, large enough that attention and the MLP change the residual stream (a wrong rope
or a wrong head split changes the tokens). Every bias and norm weight is random too, so a
loader that skips one of them is caught.

All shapes divide by 2 (4 query heads, 2 KV heads, vocab 512, intermediate 128), so that
tensor parallelism at TP=2 splits them evenly.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import torch

TINY_ARCHS = ["llama", "llama3_rope_scaling", "mistral", "qwen2", "qwen3", "smollm_tied"]

EMBEDDING_STD = 1.0  # embed_tokens and lm_head: what makes the logits peaked
MATRIX_STD = 0.1  # every other weight matrix
OUTPUT_PROJ_STD = 0.6  # o_proj and down_proj: how loudly each layer writes to the residual
BIAS_STD = 0.1  # qkv biases (qwen2)
NORM_WEIGHT_STD = 0.2  # norm weights are drawn around 1.0

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA, and divisible by TP=2
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# arch -> (model_type, config fields on top of _COMMON). Field names are the ones
# transformers' config classes take; what lands in config.json may differ (see
# tests/testkit/test_checkpoints.py for the exact keys).
_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"num_hidden_layers": 4, "head_dim": 16, "rope_theta": 10000.0}),
    "llama3_rope_scaling": (
        "llama",
        {
            "num_hidden_layers": 2,
            "head_dim": 16,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "mistral": (
        "mistral",
        {"num_hidden_layers": 2, "head_dim": 16, "rope_theta": 1000000.0, "sliding_window": None},
    ),
    # No head_dim, as in real Qwen2/2.5 config.json files: it is hidden_size / num_heads.
    "qwen2": ("qwen2", {"num_hidden_layers": 3, "rope_theta": 1000000.0}),
    # head_dim 32 != hidden_size / num_heads (16), as in real Qwen3 (0.6B: 1024 / 16 heads, 128).
    "qwen3": ("qwen3", {"num_hidden_layers": 2, "head_dim": 32, "rope_theta": 1000000.0}),
    "smollm_tied": (
        "llama",
        {
            "num_hidden_layers": 4,
            "head_dim": 16,
            "rope_theta": 100000.0,
            "tie_word_embeddings": True,
        },
    ),
}


def tiny_config(arch: str, *, tie_word_embeddings: bool = False, **overrides: Any) -> Any:
    """The transformers config object of a tiny `arch` checkpoint."""
    from transformers import AutoConfig

    if arch not in _ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {TINY_ARCHS}")
    model_type, fields = _ARCHS[arch]
    kwargs = {**_COMMON, **fields, **overrides}
    kwargs["tie_word_embeddings"] = tie_word_embeddings or kwargs.get("tie_word_embeddings", False)
    return AutoConfig.for_model(model_type, **kwargs)


def make_tiny_checkpoint(
    arch: str,
    path: Path,
    *,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    legacy_rope_keys: bool = False,
    **overrides: Any,
) -> Path:
    """Write a tiny random float32 checkpoint of `arch` into the folder `path`; returns `path`.

    `overrides` are config fields (e.g. num_hidden_layers=1). `legacy_rope_keys` writes rope
    settings the transformers 4.x way (top-level `rope_theta` and `rope_scaling`), as most
    config.json files on the hub still have them, instead of 5.x's `rope_parameters`.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, tie_word_embeddings=tie_word_embeddings, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if legacy_rope_keys:
        _write_legacy_rope_keys(path / "config.json")
    return path


SMOLLM2_VOCAB_SIZE = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def copy_tokenizer(source: Path, folder: Path, *, with_stop_ids: bool = False) -> None:
    """The tokenizer files (and chat template) of the model folder `source` into `folder`;
    `with_stop_ids`: its generation_config.json too, so the copy stops where `source` stops."""
    names = TOKENIZER_FILES + (("generation_config.json",) if with_stop_ids else ())
    copied = [name for name in names if (Path(source) / name).exists()]
    if "tokenizer.json" not in copied:
        raise FileNotFoundError(f"{source} holds no tokenizer.json")
    for name in copied:
        shutil.copy(Path(source) / name, Path(folder) / name)


def tiny_llama_with_smollm2_tokenizer(folder: Path, tokenizer: Path | None = None, *,
                                      with_stop_ids: bool = False, **overrides: Any) -> Path:
    """A tiny random llama (2 layers, hidden 64) with SmolLM2's vocabulary, tokenizer and chat
    template (from `tokenizer`, default: the default model's folder), so a gateway in front of it
    does its real text work while the model costs little. `overrides`: config fields;
    `with_stop_ids`: see copy_tokenizer."""
    from workers.default_model import fetch_default_model

    with contextlib.redirect_stderr(io.StringIO()):  # transformers' progress bar
        make_tiny_checkpoint("llama", folder, **{"vocab_size": SMOLLM2_VOCAB_SIZE, "num_hidden_layers": 2,
                                                 **overrides})
    copy_tokenizer(tokenizer or fetch_default_model(), folder, with_stop_ids=with_stop_ids)
    return Path(folder)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Draw every parameter from one seeded generator, in name order (reproducible)."""
    generator = torch.Generator().manual_seed(seed)
    tied_lm_head = model.config.tie_word_embeddings
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if tied_lm_head and name == "lm_head.weight":
                continue  # named_parameters skips it anyway; never draw it twice
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if "embed_tokens" in name or name.startswith("lm_head"):
                param.copy_(noise * EMBEDDING_STD)
            elif "norm" in name:  # input/post-attention/final RMSNorm, qwen3 q_norm/k_norm
                param.copy_(1.0 + noise * NORM_WEIGHT_STD)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                param.copy_(noise * OUTPUT_PROJ_STD)
            elif name.endswith(".bias"):
                param.copy_(noise * BIAS_STD)
            else:
                param.copy_(noise * MATRIX_STD)


def _write_legacy_rope_keys(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# -- embedding models: BERT, bare decoder bodies, sentence-transformers folders ----------------

_BERT: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
    "vocab_size": 512, "max_position_embeddings": 128, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
    "hidden_act": "gelu", "pad_token_id": 0,
}


def make_tiny_bert(path: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random `BertModel` folder (hidden 64, 4 heads, 2 layers; the pooler included, as
    in bge and e5 checkpoints). `overrides`: BertConfig fields."""
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(**{**_BERT, **overrides}))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if "LayerNorm.weight" in name:
                param.copy_(1.0 + noise * NORM_WEIGHT_STD)
            elif name.endswith(".bias"):
                param.copy_(noise * BIAS_STD)
            elif "embeddings" in name:
                param.copy_(noise * EMBEDDING_STD)
            else:
                param.copy_(noise * MATRIX_STD * 2)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_decoder_body(arch: str, path: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random decoder saved as its bare body (`Qwen3Model`, ...: no `model.` prefix, no
    LM head), as gte-Qwen2 and Qwen3-Embedding are published."""
    from transformers import AutoModel

    config = tiny_config(arch, **overrides)
    model = AutoModel.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_sentence_transformers_files(folder: Path, pooling: str, *, normalize: bool = True,
                                      matryoshka_dimensions: list[int] | None = None) -> Path:
    """Make `folder` a sentence-transformers model: modules.json (Transformer, Pooling and, when
    `normalize`, Normalize) and 1_Pooling/config.json choosing `pooling` ("cls", "mean" or
    "lasttoken"). `matryoshka_dimensions`: written into config.json (vLLM's field)."""
    folder = Path(folder)
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    modes = {f"pooling_mode_{m}": m == {"cls": "cls_token", "mean": "mean_tokens",
                                           "lasttoken": "lasttoken"}[pooling]
             for m in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
                       "weightedmean_tokens", "lasttoken")}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, **modes, "include_prompt": True}, indent=2))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128,
                                                                  "do_lower_case": False}))
    if matryoshka_dimensions is not None:
        config = json.loads((folder / "config.json").read_text())
        config["matryoshka_dimensions"] = matryoshka_dimensions
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def add_tiny_wordpiece_tokenizer(folder: Path, vocab_size: int = 512) -> Path:
    """A BERT WordPiece tokenizer of `vocab_size` entries ([PAD] [UNK] [CLS] [SEP] [MASK], the
    letters, digits and common English words) saved into `folder`, so that text reaches a tiny
    BERT as it reaches bge or e5: `[CLS] ... [SEP]`, lower-cased."""
    from transformers import BertTokenizerFast

    words = ("the of and to in is for on that with as it by this be are from at or an was which "
             "search query passage document retrieval embedding vector chunk fleet model text "
             "hello world cat dog red blue quick brown fox jumps over lazy").split()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz0123456789.,!?'-",
             *[f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"], *words]
    vocab += [f"[unused{i}]" for i in range(vocab_size - len(vocab))]
    folder = Path(folder)
    BertTokenizerFast(vocab={token: i for i, token in enumerate(vocab)}, do_lower_case=True,
                      model_max_length=512).save_pretrained(folder)
    return folder
