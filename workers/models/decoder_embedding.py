"""A decoder served for embeddings: the causal LM's body without its LM head.

Embedding checkpoints of decoders come two ways: a whole causal LM (`model.` prefix, an
`lm_head`; SmolLM2 served with `--runner pooling`) or its bare body saved as `Qwen2Model` /
`Qwen3Model` (gte-Qwen2, Qwen3-Embedding: no prefix, no head). Both load here: names get the
`model.` prefix our layers use, and a head in the file is skipped. The forward is the causal
LM's, over the paged KV cache, and returns the final hidden states (after the final norm),
which the pooling runner pools.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model_config import ModelConfig
from workers.attention_metadata import AttentionMetadata
from workers.models.llama import LlamaForCausalLM
from workers.parallel import TensorParallel
from workers.pipeline import SINGLE_STAGE, PipelineStage


def embedding_class_of(causal_lm: type[LlamaForCausalLM]) -> type[nn.Module]:
    """The embedding model of a causal LM family (its body and checkpoint names)."""

    class DecoderEmbeddingModel(nn.Module):
        is_encoder = False
        packed_modules = causal_lm.packed_modules

        def __init__(self, cfg: ModelConfig, tp: TensorParallel, max_positions: int,
                     stage: PipelineStage = SINGLE_STAGE) -> None:
            super().__init__()
            if stage.size > 1:
                raise ValueError("an embedding model runs in one pipeline stage")
            self.cfg = cfg
            self.model = causal_lm.model_class(cfg, tp, max_positions, stage)

        def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
            # -> [num_tokens, hidden], the final norm applied
            return self.model(token_ids, positions, kv_caches, meta)

        def stage_tensor_name(self, name: str) -> str | None:
            if name.startswith("lm_head."):
                return None
            return name if name.startswith("model.") else f"model.{name}"

    DecoderEmbeddingModel.__name__ = f"{causal_lm.__name__}Embedding"
    return DecoderEmbeddingModel
