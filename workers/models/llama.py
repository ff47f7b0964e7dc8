"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral); Qwen2/Qwen3 reuse it with small changes.

Reads like single-device code: tensor parallelism lives inside the layers, and the only
collectives are at the end of `o_proj` and `down_proj` (row-parallel) and in the
vocab-parallel embedding and LM head.

Under pipeline parallelism (workers/pipeline.py) a model holds only its stage's layers:
the others are `MissingLayer`s, so that layer indices (and checkpoint names) stay global.
Stage 0 alone has the embedding, the last stage alone the final norm and the LM head; a
stage other than the last returns the residual stream for the next one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.model_config import ModelConfig
from workers.attention_metadata import AttentionMetadata
from workers.layers import triton_fused, triton_quant
from workers.layers.attention import PagedAttention
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding
from workers.parallel import TensorParallel
from workers.pipeline import SINGLE_STAGE, PipelineStage


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias, tp
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        q_start, q_size = self.qkv_proj.shards[0]
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, tp, in_shard=(q_start, q_size)
        )
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: [num_tokens, hidden] -> q: [num_tokens, heads, head_dim], k/v: [.., kv_heads, ..]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        return (
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.reshape(-1, self.num_kv_heads, self.head_dim),
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        return self.o_proj(self.attn(positions, q, k, v, self.rotary, kv_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], False, tp)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        if self.down_proj.takes_fp8_input(gate_up):  # FP8 weights on CUDA: quant fused in
            return self.down_proj(triton_quant.silu_and_mul_quant(gate_up))
        if triton_fused.is_available(gate_up):
            return self.down_proj(triton_fused.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    attention_class = LlamaAttention

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = self.attention_class(cfg, tp, rotary)
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # FP8 linears on CUDA: the norms hand them e4m3 rows (the quant fused into the norm).
        quantize = self.self_attn.qkv_proj.takes_fp8_input(x)
        if residual is None:
            x, residual = self.input_layernorm(x, quantize=quantize), x
        else:
            x, residual = self.input_layernorm(x, residual, quantize=quantize)
        x = self.self_attn(positions, x, kv_cache, meta)
        quantize = self.mlp.gate_up_proj.takes_fp8_input(x)
        x, residual = self.post_attention_layernorm(x, residual, quantize=quantize)
        return self.mlp(x), residual


class MissingLayer(nn.Module):
    """A layer another pipeline stage holds: no parameters, never called."""


class LlamaModel(nn.Module):
    layer_class = LlamaDecoderLayer

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, max_positions: int,
                 stage: PipelineStage = SINGLE_STAGE) -> None:
        super().__init__()
        self.stage = stage
        self.layer_range = stage.layers(cfg.num_layers)
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
                             if stage.is_first else None)
        # One table shared by every layer.
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(
            self.layer_class(cfg, tp, rotary) if index in self.layer_range else MissingLayer()
            for index in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if stage.is_last else None

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
        meta: AttentionMetadata, hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # token_ids, positions: [num_tokens]; kv_caches: [this stage's layers, 2, blocks, ...];
        # hidden: [num_tokens, hidden], the previous stage's output (None on stage 0)
        x = self.embed_tokens(token_ids) if hidden is None else hidden
        residual = None
        layers = self.layers[self.layer_range.start:self.layer_range.stop]
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        if self.norm is None:  # the next stage's first layer starts from the residual stream
            return x + residual
        x, _ = self.norm(x, residual)
        return x  # [num_tokens, hidden]


class LlamaForCausalLM(nn.Module):
    model_class = LlamaModel
    # checkpoint projection name -> (our fused module, its shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, max_positions: int,
                 stage: PipelineStage = SINGLE_STAGE) -> None:
        super().__init__()
        self.cfg = cfg
        self.stage = stage
        self.model = self.model_class(cfg, tp, max_positions, stage)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp) if stage.is_last else None
        if cfg.tie_word_embeddings and stage.is_first and stage.is_last:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
        meta: AttentionMetadata, hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(token_ids, positions, kv_caches, meta, hidden)

    def stage_tensor_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor loads into on this pipeline stage (before q/k/v
        and gate/up fusing); None when another stage holds it."""
        if name.startswith("model.layers."):
            return name if int(name.split(".")[2]) in self.model.layer_range else None
        if name.startswith("model.embed_tokens."):
            if self.stage.is_first:
                return name
            # A last stage without the embedding loads it as its own LM head when they are tied.
            return "lm_head.weight" if self.cfg.tie_word_embeddings and self.stage.is_last else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if self.stage.is_last else None
        return name

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_seqs, hidden] -> [num_seqs, vocab] (full vocab on every rank)
        return self.lm_head(hidden)
