"""What a call's body becomes before it is queued: one (prompt ids, SamplingParams) per choice,
and everything the handlers need to shape its answer. Each API builds it from its own body
(gateway/api/openai/params.py builds the chat's and the completion's); queueing, following and
charging a tenant read it here, whichever API made it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.tokens.models import ServedModel
from shared.sampling import SamplingParams


@dataclass
class ChoicePlan:
    index: int  # OpenAI's choice index: prompt_index * n + i
    prompt_index: int
    prompt_ids: list[int]
    sampling: SamplingParams


@dataclass
class Plan:
    """Everything the handlers need to queue a request and shape its answer."""

    api: str  # "chat" or "completion"
    model: ServedModel
    choices: list[ChoicePlan]
    prompt_texts: list[str]  # per prompt, for echo
    num_prompt_tokens: list[int]  # per prompt
    priority: int = 0
    deadline: float | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: none; N: the chosen token's and the top N
    echo: bool = False
    is_prompt_only: bool = False  # echo with max_tokens 0: the prompt alone (one token made, dropped)
    prompt_logprobs: int | None = None  # vLLM's parameter: its shape, with the top N, on each choice
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    # chat with tools: the format calls are read in (gateway/api/openai/tools.py)
    tool_format: str | None = None
    parallel_tool_calls: bool = True  # False: an answer's first call only
    is_tool_choice_forced: bool = False  # required or named: the answer is calls, never content
    max_tokens_given: bool = True  # False: a chat without max_tokens (its choices run to a default)
    created: int = field(default_factory=lambda: int(time.time()))
    # The LoRA adapter the call named as its model (gateway/api/models/adapters.py).
    lora_name: str | None = None

    @property
    def served_name(self) -> str:
        """The model the answer names: the adapter called, else the base model."""
        return self.lora_name or self.model.name
