"""The models a gateway fronts: tokenizer, chat template and context window of each.

Tokenization happens here, in the gateway, so schedulers only ever see token ids and a
too-long prompt is refused before it is queued.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import BadRequest, ModelNotFound
from gateway.settings import ModelSpec
from gateway.token_pieces import PieceEncoder
from shared.errors import ModelLoadError
from shared.model_config import load_model_config
from shared.token_bytes import token_bytes_reader
from shared.tokenizer import encode_ids, load_tokenizer


@functools.lru_cache(maxsize=16)
def _load_tokenizer(path: str) -> Any:
    """Loaded once per process: tokenizers are read-only here, and loading one takes a while."""
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise ModelLoadError(f"model folder {path!r} has no tokenizer; the gateway tokenizes prompts")
    return tokenizer


@dataclass
class ServedModel:
    name: str
    path: str
    tokenizer: Any
    context_window: int  # prompt + output tokens
    vocab_size: int
    created: int = field(default_factory=lambda: int(time.time()))
    _token_texts: dict[int, str] = field(default_factory=dict)  # token id -> its text (logprobs)
    _token_bytes: dict[int, bytes] = field(default_factory=dict)  # token id -> its own bytes (logprobs)
    _read_token_bytes: Callable[[int], bytes] | None = field(default=None, repr=False)
    # A chat template's text, encoded from its pieces' cached ids (None: this tokenizer's
    # encodings are not its pieces', gateway/token_pieces.py): a shared system prompt once.
    _pieces: PieceEncoder | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self._pieces is None:
            self._pieces = PieceEncoder.for_tokenizer(self.tokenizer)

    @classmethod
    def load(cls, spec: ModelSpec) -> ServedModel:
        config = load_model_config(spec.path)
        return cls(spec.name, spec.path, _load_tokenizer(spec.path), config.context_window,
                   config.vocab_size)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    def encode_text(self, text: str, *, param: str = "prompt") -> list[int]:
        ids = encode_ids(self.tokenizer, text)
        if not ids:
            raise BadRequest("the prompt is empty", param=param)
        return ids

    def check_token_ids(self, ids: list[int], *, param: str = "prompt") -> list[int]:
        if not ids:
            raise BadRequest("the prompt is empty", param=param)
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param=param)
        return ids

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, *,
                    add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        """The chat template's text (ending with the assistant's turn opening, unless
        add_generation_prompt is False: /tokenize) and its ids; `tools` go to a template that
        renders them itself (gateway/openai/tools.py)."""
        if not self.has_chat_template:
            raise BadRequest(f"model {self.name!r} has no chat template; use /v1/completions",
                             param="messages")
        if hasattr(self.tokenizer, "chat_ids"):  # a chat built as ids (shared/qwen_tokenizer.py)
            return self._encode_chat_ids(messages)
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools,
                                                      add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
        except Exception as exc:  # noqa: BLE001 - a template may raise anything (jinja raise_exception)
            raise BadRequest(f"the chat template refused the messages: {exc}", param="messages") from None
        if self._pieces is not None:
            ids = self._pieces.encode(text)
        else:
            ids = encode_ids(self.tokenizer, text, add_special_tokens=False)
        if not ids:
            raise BadRequest("the messages make an empty prompt", param="messages")
        return text, ids

    def _encode_chat_ids(self, messages: list[dict]) -> tuple[str, list[int]]:
        """Qwen's ChatML: each message's text encoded with special tokens as plain text, so no
        message can close its turn early (a text template would encode them as specials)."""
        try:
            ids = self.tokenizer.chat_ids(messages)
        except ValueError as exc:
            raise BadRequest(str(exc), param="messages") from None
        return self.tokenizer.decode(ids), ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (gateway/token_bytes.py): part of a character's for a token
        that splits one, where its text alone would be U+FFFD."""
        data = self._token_bytes.get(token_id)
        if data is None:
            if self._read_token_bytes is None:
                self._read_token_bytes = token_bytes_reader(self.tokenizer)
            data = self._token_bytes[token_id] = self._read_token_bytes(token_id)
        return data


class ModelRegistry:
    def __init__(self, models: list[ServedModel]) -> None:
        self._models = {m.name: m for m in models}  # served name -> model

    @classmethod
    def load(cls, specs: list[ModelSpec]) -> ModelRegistry:
        if not specs:
            raise ModelLoadError("the gateway needs at least one --model")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ModelLoadError(f"two models are served under one name: {names}")
        return cls([ServedModel.load(spec) for spec in specs])

    @property
    def names(self) -> list[str]:
        return list(self._models)

    def __iter__(self):
        return iter(self._models.values())

    def get(self, name: str | None) -> ServedModel:
        if name is None:
            if len(self._models) == 1:
                return next(iter(self._models.values()))
            raise BadRequest(f"model is required (served: {', '.join(self._models)})", param="model")
        model = self._models.get(name)
        if model is None:
            raise ModelNotFound(f"the model {name!r} does not exist (served: {', '.join(self._models)})",
                                param="model")
        return model
