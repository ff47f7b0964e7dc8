"""model_type in config.json -> our model class."""

from __future__ import annotations

from torch import nn

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
