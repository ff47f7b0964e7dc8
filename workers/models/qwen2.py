"""Qwen2 / Qwen2.5: the Llama architecture with biases on the q, k and v projections.

`ModelConfig.attention_bias` is True for Qwen2 checkpoints, which is all it takes.
"""

from __future__ import annotations

from workers.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
