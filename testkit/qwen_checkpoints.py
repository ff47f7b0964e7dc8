"""Random-weight Qwen (v1, `QWenLMHeadModel`) folders laid out as the published ones, and the
same weights as a transformers `Qwen2ForCausalLM` to judge them by.

A folder holds what Qwen-14B-Chat's does, minus its .py files: config.json (model_type "qwen",
auto_map naming the remote code we never run, bf16/fp16/fp32 flags instead of torch_dtype),
model*.safetensors with `transformer.*` names (c_attn stacking q, k and v with a bias),
qwen.tiktoken (a synthetic byte-level BPE: the 256 bytes, some English words' prefixes, then
random byte strings up to the size asked), generation_config.json (chat_format chatml, eos
<|endoftext|>) and tokenizer_config.json (auto_map QWenTokenizer).

`qwen_to_qwen2` rewrites such a folder as Qwen2 (the architecture is the same: RMSNorm, q/k/v
bias, untied head): c_attn split into q/k/v, w2 -> gate_proj, w1 -> up_proj, c_proj ->
down_proj / o_proj. Inside `seq_length` (where logn and dynamic NTK change nothing) transformers'
Qwen2 on it is the reference.

The weights are drawn as testkit/checkpoints.py draws its tiny ones (embeddings and head std
1.0, output projections 0.6, other matrices 0.1, biases 0.1, norms 1 + 0.2 noise), so greedy
tokens are not near-ties; `std` overrides it for large shapes (random_models.py's scale).
"""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path
from typing import Any

from shared.qwen_tokenizer import SPECIAL_TOKENS

TINY_QWEN: dict[str, Any] = dict(
    hidden_size=64, num_attention_heads=4, kv_channels=16, num_hidden_layers=3, intermediate_size=256,
    seq_length=64, max_position_embeddings=512, num_ranks=900, vocab_size=1120,  # 900 + 208 specials, padded
    rotary_emb_base=10000.0, layer_norm_epsilon=1e-6, use_logn_attn=True, use_dynamic_ntk=True,
)
# Qwen-14B-Chat's shape: 40 layers of hidden 5120, 40 heads of 128, MLP width 13696
# (intermediate_size 27392 is twice it), 151,643 ranks + 208 specials padded to 152,064.
QWEN_14B: dict[str, Any] = dict(
    hidden_size=5120, num_attention_heads=40, kv_channels=128, num_hidden_layers=40, intermediate_size=27392,
    seq_length=2048, max_position_embeddings=8192, num_ranks=151643, vocab_size=152064,
    rotary_emb_base=10000.0, layer_norm_epsilon=1e-6, use_logn_attn=True, use_dynamic_ntk=True,
)
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one "
         "had by word but not what all were we when your can said there use an each which she do how their "
         "if will up other about out many then them these so some her would make like him into time has look "
         "two more write go see number no way could people my than first water been call who oil its now "
         "find hello world paris capital france assistant user system helpful").split()


def synthetic_ranks(num_ranks: int, seed: int = 0) -> dict[bytes, int]:
    """A byte-level BPE vocabulary of `num_ranks` tokens: every byte, then each word's prefixes
    (with and without a leading space, so BPE merges them step by step; WORDS, then the words
    of `tokenfleet bench`'s prompts, so those are about a token each as with a real vocabulary),
    then random byte strings (never produced by encoding, as rare tokens of a real vocabulary
    mostly are)."""
    from tokenfleet.bench import WORDS as BENCH_WORDS

    tokens = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    for word in (*WORDS, *BENCH_WORDS):
        for text in (word, " " + word):
            data = text.encode()
            for end in range(2, len(data) + 1):
                if data[:end] not in seen:
                    seen.add(data[:end])
                    tokens.append(data[:end])
    rng = random.Random(seed)
    while len(tokens) < num_ranks:
        token = bytes(rng.randrange(256) for _ in range(rng.randint(2, 8)))
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    return {token: rank for rank, token in enumerate(tokens[:num_ranks])}


def write_tiktoken(path: Path, ranks: dict[bytes, int]) -> None:
    lines = (f"{base64.b64encode(token).decode()} {rank}" for token, rank in ranks.items())
    Path(path).write_text("\n".join(lines) + "\n")


def qwen_config(shape: dict[str, Any]) -> dict[str, Any]:
    """config.json of a Qwen folder of `shape` (TINY_QWEN's keys), as the published ones."""
    fields = {k: v for k, v in shape.items() if k != "num_ranks"}
    return {
        "architectures": ["QWenLMHeadModel"],
        "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig",
                     "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
        "model_type": "qwen",
        "attn_dropout_prob": 0.0, "emb_dropout_prob": 0.0, "initializer_range": 0.02,
        "bf16": False, "fp16": False, "fp32": False,
        "no_bias": True, "rotary_pct": 1.0, "scale_attn_weights": True, "softmax_in_fp32": False,
        "tie_word_embeddings": False, "tokenizer_class": "QWenTokenizer", "use_cache": True,
        "use_cache_quantization": False, "use_cache_kernel": False, "use_flash_attn": "auto",
        **fields,
    }


def _draw_tensors(shape: dict[str, Any], layers: range, generator, device, dtype, std: float | None):
    """The `transformer.*` tensors of `layers` (plus the embedding, final norm and head when the
    range starts / ends the model), drawn in a fixed order."""
    import torch

    hidden, inter = shape["hidden_size"], shape["intermediate_size"] // 2
    qkv = 3 * shape["num_attention_heads"] * shape["kv_channels"]
    vocab = shape["vocab_size"]

    def normal(*dims, scale):
        return (torch.randn(dims, generator=generator, device=device, dtype=torch.float32)
                * (std if std is not None else scale)).to(dtype)

    def norm(n):
        return (1.0 + torch.randn(n, generator=generator, device=device) * (0.0 if std else 0.2)).to(dtype)

    out = {}
    if layers.start == 0:
        out["transformer.wte.weight"] = normal(vocab, hidden, scale=1.0)
    for i in layers:
        p = f"transformer.h.{i}."
        out[p + "ln_1.weight"] = norm(hidden)
        out[p + "attn.c_attn.weight"] = normal(qkv, hidden, scale=0.1)
        out[p + "attn.c_attn.bias"] = normal(qkv, scale=0.1)
        out[p + "attn.c_proj.weight"] = normal(hidden, qkv // 3, scale=0.6)
        out[p + "ln_2.weight"] = norm(hidden)
        out[p + "mlp.w1.weight"] = normal(inter, hidden, scale=0.1)
        out[p + "mlp.w2.weight"] = normal(inter, hidden, scale=0.1)
        out[p + "mlp.c_proj.weight"] = normal(hidden, inter, scale=0.6)
    if layers.stop == shape["num_hidden_layers"]:
        out["transformer.ln_f.weight"] = norm(hidden)
        out["lm_head.weight"] = normal(vocab, hidden, scale=1.0)
    return {name: t.contiguous().cpu() for name, t in out.items()}


def make_qwen_checkpoint(path: Path, shape: dict[str, Any] | None = None, *, seed: int = 0,
                         device: str = "cpu", dtype: str = "float32", std: float | None = None,
                         layers_per_file: int = 4, **overrides: Any) -> Path:
    """Write a random Qwen (v1) folder of `shape` (default TINY_QWEN) with `overrides` into
    `path`; returns it. Weights are drawn on `device` and written `layers_per_file` layers per
    safetensors file (host memory holds one file's at a time)."""
    import torch
    from safetensors.torch import save_file

    shape = {**(shape or TINY_QWEN), **overrides}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    n = shape["num_hidden_layers"]
    starts = list(range(0, n, layers_per_file))
    for number, start in enumerate(starts, 1):
        tensors = _draw_tensors(shape, range(start, min(start + layers_per_file, n)), generator, device,
                                torch_dtype, std)
        save_file(tensors, str(path / f"model-{number:05d}-of-{len(starts):05d}.safetensors"),
                  metadata={"format": "pt"})
        del tensors
    config = qwen_config(shape)
    config[{"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]] = True
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    ranks = synthetic_ranks(shape["num_ranks"], seed)
    write_tiktoken(path / "qwen.tiktoken", ranks)
    ids = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    generation = {"chat_format": "chatml", "eos_token_id": ids["<|endoftext|>"],
                  "pad_token_id": ids["<|endoftext|>"],
                  "stop_words_ids": [[ids["<|im_end|>"]], [ids["<|im_start|>"]]],
                  "max_window_size": shape["max_position_embeddings"] // 4 * 3, "max_new_tokens": 512,
                  "do_sample": True, "top_k": 0, "top_p": 0.8, "repetition_penalty": 1.1}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer_config = {"model_max_length": shape["max_position_embeddings"],
                        "tokenizer_class": "QWenTokenizer",
                        "auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]}}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return path


def qwen_to_qwen2(folder: Path, out: Path) -> Path:
    """The Qwen folder's weights as a transformers Qwen2ForCausalLM folder at `out` (float32)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    raw = json.loads((Path(folder) / "config.json").read_text())
    heads, head_dim = raw["num_attention_heads"], raw["kv_channels"]
    config = Qwen2Config(
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"] // 2,
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=head_dim, vocab_size=raw["vocab_size"],
        max_position_embeddings=raw["max_position_embeddings"],
        rms_norm_eps=raw["layer_norm_epsilon"], rope_theta=raw["rotary_emb_base"], tie_word_embeddings=False,
        use_sliding_window=False, hidden_act="silu",
    )
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is no dict)
                tensor = reader.get_tensor(name).float()
                for new_name, value in _qwen2_names(name, tensor, heads * head_dim):
                    tensors[new_name] = value.contiguous()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _qwen2_names(name: str, tensor, q_size: int):
    if name == "transformer.wte.weight":
        return [("model.embed_tokens.weight", tensor)]
    if name == "transformer.ln_f.weight":
        return [("model.norm.weight", tensor)]
    if name == "lm_head.weight":
        return [(name, tensor)]
    index, rest = name[len("transformer.h."):].split(".", 1)
    p = f"model.layers.{index}."
    if rest.startswith("attn.c_attn."):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = tensor.split(q_size, dim=0)
        return [(f"{p}self_attn.{proj}.{kind}", t)
                for proj, t in (("q_proj", q), ("k_proj", k), ("v_proj", v))]
    renames = {"ln_1.weight": "input_layernorm.weight", "ln_2.weight": "post_attention_layernorm.weight",
               "attn.c_proj.weight": "self_attn.o_proj.weight", "mlp.w2.weight": "mlp.gate_proj.weight",
               "mlp.w1.weight": "mlp.up_proj.weight", "mlp.c_proj.weight": "mlp.down_proj.weight"}
    return [(p + renames[rest], tensor)]


def write_qwen_14b(folder: Path, device: str = "cuda", seed: int = 0) -> int:
    """Qwen-14B-Chat's shape (QWEN_14B) with random bf16 weights (normal, std 0.02, as
    random_models.py draws its large models; norms 1), drawn on `device`, and a synthetic
    qwen.tiktoken of the real size (151,643 ranks): the GPU benchmarks' stand-in for the seed's
    model. Returns its number of parameters."""
    import torch

    make_qwen_checkpoint(folder, QWEN_14B, seed=seed, device=device, dtype="bfloat16", std=0.02)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the engine that loads it needs the memory
    return qwen_num_params(QWEN_14B)


def qwen_num_params(shape: dict[str, Any]) -> int:
    hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"] // 2, shape["num_hidden_layers"]
    qkv = 3 * shape["num_attention_heads"] * shape["kv_channels"]
    per_layer = 2 * hidden + qkv * hidden + qkv + hidden * qkv // 3 + 3 * inter * hidden
    return 2 * shape["vocab_size"] * hidden + hidden + layers * per_layer


def main(argv: list[str] | None = None) -> None:
    """python -m testkit.qwen_checkpoints OUT [--shape qwen14b|tiny] [--device cuda]"""
    import argparse

    parser = argparse.ArgumentParser(description="write a random Qwen (v1) folder")
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=("qwen14b", "tiny"), default="qwen14b")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    if args.shape == "tiny":
        make_qwen_checkpoint(args.out)
    else:
        write_qwen_14b(args.out, args.device)
    print(args.out)


if __name__ == "__main__":
    main()
