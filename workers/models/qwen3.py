"""Qwen3: Llama-style attention with an RMSNorm over each head of q and k before RoPE."""

from __future__ import annotations

import torch

from shared.model_config import ModelConfig
from workers.attention_metadata import AttentionMetadata
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding
from workers.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)
from workers.parallel import TensorParallel


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, tp, rotary)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.attn(positions, q, k, v, self.rotary, kv_cache, meta))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_class = Qwen3Model
