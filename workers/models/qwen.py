"""Qwen (v1, `QWenLMHeadModel`: Qwen-7B/14B/72B and their -Chat), on the Qwen2 layers.

The architecture is Qwen2's (RMSNorm, q/k/v with a bias, no other bias, SwiGLU, no GQA) under
other names, so the checkpoint's tensors are renamed onto the Llama/Qwen2 modules and every
engine feature (TP, PP, quantized weights, FP8 KV, CUDA graphs, prefix caching) comes with them:
- `transformer.h.N.attn.c_attn` (q, k and v stacked, with a bias) loads into `qkv_proj` in one
  go: QKVParallelLinear's shard id "qkv" cuts this rank's rows of each of the three;
- `mlp.w2` is the gated half (c_proj(w1(x) * silu(w2(x)))), so it is gate_proj and w1 up_proj.

Past the training context `seq_length` (shared/long_context.py): with `use_logn_attn` each
query is scaled by its position's logn factor (it commutes with the rotary embedding, so it is
applied to q before it); with `use_dynamic_ntk` the rotary table is one table per NTK alpha,
stacked, and the runner hands the model positions already offset into its sequence's table
(SequenceWork.rope_offset). The true position is then `positions % stride`.
"""

from __future__ import annotations

import torch

from shared.long_context import logn_scale, ntk_base, num_ntk_variants, variant_alpha
from shared.model_config import ModelConfig
from workers.attention_metadata import AttentionMetadata
from workers.layers.rotary import RotaryEmbedding
from workers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from workers.parallel import TensorParallel
from workers.pipeline import SINGLE_STAGE, PipelineStage

# checkpoint name (after "transformer.h.N.") -> ours (after "model.layers.N.")
_LAYER_NAMES = {
    "ln_1.": "input_layernorm.",
    "ln_2.": "post_attention_layernorm.",
    "attn.c_attn.": "self_attn.c_attn.",  # -> qkv_proj through packed_modules
    "attn.c_proj.": "self_attn.o_proj.",
    "mlp.w1.": "mlp.w1.",  # -> gate_up_proj, shard 1 (up)
    "mlp.w2.": "mlp.w2.",  # -> gate_up_proj, shard 0 (gate)
    "mlp.c_proj.": "mlp.down_proj.",
}


def checkpoint_to_ours(name: str) -> str:
    """A Qwen checkpoint tensor's name in the Llama layout (before q/k/v, gate/up fusing)."""
    if name.startswith("transformer.h."):
        index, rest = name[len("transformer.h."):].split(".", 1)
        for theirs, ours in _LAYER_NAMES.items():
            if rest.startswith(theirs):
                return f"model.layers.{index}.{ours}{rest[len(theirs):]}"
        return f"model.layers.{index}.{rest}"
    if name.startswith("transformer.wte."):
        return "model.embed_tokens." + name[len("transformer.wte."):]
    if name.startswith("transformer.ln_f."):
        return "model.norm." + name[len("transformer.ln_f."):]
    return name


class NTKRotaryEmbedding(RotaryEmbedding):
    """One cos/sin table per NTK alpha, stacked: rows [v * stride, (v + 1) * stride) hold
    variant v's (alpha 2^(v+1) - 1, base raised by alpha^(d/(d-2))). The Triton rope kernel
    and the PyTorch path both index rows by the positions they get, so neither knows."""

    def __init__(self, head_dim: int, stride: int, theta: float, seq_length: int) -> None:
        torch.nn.Module.__init__(self)
        tables = [RotaryEmbedding(head_dim, stride, ntk_base(theta, variant_alpha(v), head_dim), None)
                  for v in range(num_ntk_variants(stride, seq_length))]
        self.register_buffer("cos", torch.cat([t.cos for t in tables]), persistent=False)
        self.register_buffer("sin", torch.cat([t.sin for t in tables]), persistent=False)


class QWenAttention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, tp, rotary)
        self.register_buffer("logn", None, persistent=False)  # [stride] query scales (use_logn_attn)
        self.stride = 0  # rows of one rotary table (positions past it index the NTK tables)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        if self.logn is not None:
            # positions may be offset into an NTK table: % stride gives the true position
            q = q * self.logn[positions % self.stride].to(q.dtype)[:, None, None]
        return self.o_proj(self.attn(positions, q, k, v, self.rotary, kv_cache, meta))


class QWenDecoderLayer(LlamaDecoderLayer):
    attention_class = QWenAttention


class QWenModel(LlamaModel):
    layer_class = QWenDecoderLayer

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, max_positions: int,
                 stage: PipelineStage = SINGLE_STAGE) -> None:
        super().__init__(cfg, tp, max_positions, stage)
        seq_length = cfg.seq_length or max_positions
        rotary = (NTKRotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, seq_length)
                  if cfg.use_dynamic_ntk else None)
        scales = ([logn_scale(p, seq_length) for p in range(max_positions)]
                  if cfg.use_logn_attn else None)
        for layer in self.layers[self.layer_range.start:self.layer_range.stop]:
            attn = layer.self_attn
            attn.stride = max_positions
            if rotary is not None:
                attn.rotary = rotary  # one stacked table shared by every layer, as the plain one
            if scales is not None:  # a buffer of each layer's: it moves with the model
                attn.logn = torch.tensor(scales, dtype=torch.float32)


class QWenLMHeadModel(LlamaForCausalLM):
    model_class = QWenModel
    packed_modules = {
        "c_attn": ("qkv_proj", "qkv"),
        "w2": ("gate_up_proj", 0),  # the gated half
        "w1": ("gate_up_proj", 1),
    }

    def stage_tensor_name(self, name: str) -> str | None:
        return super().stage_tensor_name(checkpoint_to_ours(name))
