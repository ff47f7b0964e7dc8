"""model_type in config.json -> our model class."""

from __future__ import annotations

from torch import nn

from workers.models.bert import BertModel
from workers.models.decoder_embedding import embedding_class_of
from workers.models.llama import LlamaForCausalLM
from workers.models.qwen import QWenLMHeadModel
from workers.models.qwen2 import Qwen2ForCausalLM
from workers.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen": QWenLMHeadModel,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}

# model_type -> our model class under the pooling runner (workers/pooling_runner.py): the final
# hidden states, no LM head. Qwen (v1) is served for generation only.
POOLING_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": embedding_class_of(LlamaForCausalLM),
    "mistral": embedding_class_of(LlamaForCausalLM),
    "qwen2": embedding_class_of(Qwen2ForCausalLM),
    "qwen3": embedding_class_of(Qwen3ForCausalLM),
    "bert": BertModel,
}
