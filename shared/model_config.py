"""The subset of a Hugging Face config.json that our model code needs, read and checked."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from shared.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen", "qwen2", "qwen3", "bert")
# Encoders: bidirectional attention, no KV cache; served by the pooling runner only.
ENCODER_MODEL_TYPES = ("bert",)
BERT_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


@dataclass
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: q/k/v carry biases
    hidden_act: str = "silu"
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # "fp8" when the checkpoint's linear weights are stored quantized (compressed-tensors).
    checkpoint_quantization: str | None = None
    # Qwen (v1) past its training context: `seq_length` is that context; logn attention scales
    # the queries past it, dynamic NTK raises the rotary base by the prompt's length
    # (shared/long_context.py).
    seq_length: int | None = None
    use_logn_attn: bool = False
    use_dynamic_ntk: bool = False
    # Encoders (BERT): token type embeddings; LayerNorm's eps is in rms_norm_eps.
    type_vocab_size: int = 0

    @property
    def is_encoder(self) -> bool:
        return self.model_type in ENCODER_MODEL_TYPES

    @property
    def context_window(self) -> int:
        """Longest sequence we run exactly: a sliding window shorter than the context caps it."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def load_model_config(folder: str | Path) -> ModelConfig:
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {str(folder)!r} does not exist")
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"model folder {str(folder)!r} has no config.json") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"model type {model_type!r} in {path} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    try:
        if model_type == "qwen":
            return _from_qwen_dict(raw, folder, path)
        if model_type == "bert":
            return _from_bert_dict(raw, folder, path)
        return _from_dict(raw, model_type, folder)
    except KeyError as exc:
        raise ModelLoadError(f"{path} lacks the field {exc.args[0]!r}") from None


def _from_dict(raw: dict, model_type: str, folder: Path) -> ModelConfig:
    # transformers 5 nests rope settings under rope_parameters; older files use
    # rope_theta and rope_scaling at the top level.
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    num_heads = raw["num_attention_heads"]
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ModelLoadError(f"hidden_act {hidden_act!r} is not supported (only silu)")
    use_sliding = raw.get("use_sliding_window", model_type == "mistral")
    return ModelConfig(
        model_type=model_type,
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        vocab_size=raw["vocab_size"],
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=None if rope_type == "default" else rope,
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=raw.get("attention_bias", model_type == "qwen2"),
        hidden_act=hidden_act,
        sliding_window=raw.get("sliding_window") if use_sliding else None,
        eos_token_ids=_eos_token_ids(raw, folder),
        checkpoint_quantization=_checkpoint_quantization(raw.get("quantization_config")),
    )


def _from_qwen_dict(raw: dict, folder: Path, path: Path) -> ModelConfig:
    """Qwen (v1, `QWenLMHeadModel`): its own field names. `intermediate_size` is twice the MLP
    width (w1 and w2 together); `kv_channels` is the head dim; no GQA; RMSNorm; q/k/v carry a
    bias (c_attn) whatever `no_bias` says, which covers the other projections only."""
    rotary_pct = float(raw["rotary_pct"])
    if rotary_pct != 1.0:
        raise ModelLoadError(f"{path}: rotary_pct {rotary_pct} is not supported (only 1.0)")
    if raw["intermediate_size"] % 2:
        raise ModelLoadError(f"{path}: intermediate_size {raw['intermediate_size']} is not even "
                             "(it is twice the MLP width)")
    if raw.get("no_bias", True) is not True:
        raise ModelLoadError(f"{path}: no_bias false is not supported (only c_attn carries a bias)")
    num_heads = raw["num_attention_heads"]
    seq_length = raw["seq_length"]
    return ModelConfig(
        model_type="qwen",
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"] // 2,
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=raw["kv_channels"],
        vocab_size=raw["vocab_size"],
        max_position_embeddings=raw["max_position_embeddings"],
        rms_norm_eps=float(raw["layer_norm_epsilon"]),
        rope_theta=float(raw["rotary_emb_base"]),
        rope_scaling=None,
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=True,
        eos_token_ids=_eos_token_ids(raw, folder),
        checkpoint_quantization=_checkpoint_quantization(raw.get("quantization_config")),
        seq_length=int(seq_length),
        use_logn_attn=bool(raw["use_logn_attn"]),
        use_dynamic_ntk=bool(raw["use_dynamic_ntk"]),
    )


def _from_bert_dict(raw: dict, folder: Path, path: Path) -> ModelConfig:
    """BERT (`BertModel`): post-LN, absolute positions, token types, biases everywhere."""
    position_type = raw.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ModelLoadError(f"{path}: position_embedding_type {position_type!r} is not supported "
                             "(only absolute)")
    hidden_act = raw.get("hidden_act", "gelu")
    if hidden_act not in BERT_ACTIVATIONS:
        raise ModelLoadError(f"{path}: hidden_act {hidden_act!r} is not supported "
                             f"(supported: {', '.join(BERT_ACTIVATIONS)})")
    num_heads = raw["num_attention_heads"]
    return ModelConfig(
        model_type="bert",
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=raw["hidden_size"] // num_heads,
        vocab_size=raw["vocab_size"],
        max_position_embeddings=raw.get("max_position_embeddings", 512),
        rms_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        rope_theta=0.0,
        rope_scaling=None,
        tie_word_embeddings=False,
        attention_bias=True,
        hidden_act=hidden_act,
        eos_token_ids=_eos_token_ids(raw, folder),
        type_vocab_size=int(raw.get("type_vocab_size", 2)),
    )


def _checkpoint_quantization(quant: dict | None) -> str | None:
    """What a config.json's `quantization_config` asks of us; a scheme we cannot run exactly is
    refused by name rather than loaded wrong. We run llm-compressor's FP8_DYNAMIC scheme (FP8
    weights with a scale per output channel, activations scaled per token while serving)."""
    if not quant:
        return None
    method = quant.get("quant_method")
    if method != "compressed-tensors":
        raise ModelLoadError(f"checkpoint quantization {method!r} is not supported "
                             "(supported: compressed-tensors FP8 with channel-wise weight scales)")
    fmt = quant.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ModelLoadError(f"compressed-tensors format {fmt!r} is not supported (float-quantized only)")
    ignored = set(quant.get("ignore") or [])
    if ignored - {"lm_head"}:
        raise ModelLoadError(f"compressed-tensors checkpoints that leave layers unquantized are not "
                             f"supported: ignore={sorted(ignored)}")
    for name, group in (quant.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        wanted = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
        got = {key: weights.get(key) for key in wanted}
        if got != wanted:
            raise ModelLoadError(f"compressed-tensors group {name!r}: weights {got} are not supported "
                                 f"(supported: {wanted})")
        inputs = group.get("input_activations")
        if inputs and not (inputs.get("dynamic") is True and inputs.get("strategy") == "token"):
            raise ModelLoadError(f"compressed-tensors group {name!r}: static or non-token activation "
                                 "scales are not supported (supported: dynamic, per token)")
    if not quant.get("config_groups"):
        raise ModelLoadError("compressed-tensors quantization_config has no config_groups")
    return "fp8"


def _eos_token_ids(raw: dict, folder: Path) -> list[int]:
    """End-of-sequence ids from config.json and generation_config.json, merged."""
    ids: list[int] = []
    sources = [raw]
    gen_path = folder / "generation_config.json"
    if gen_path.exists():
        try:
            sources.append(json.loads(gen_path.read_text()))
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{gen_path} is not valid JSON: {exc}") from None
    for source in sources:
        value = source.get("eos_token_id")
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return ids
