"""The responses of /v1/models and of the LoRA adapters' load and unload routes, for /openapi.json."""

from __future__ import annotations

from typing import Literal

from gateway.core.shapes import Shape


class ModelCard(Shape):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str | None = None  # a LoRA adapter's folder
    parent: str | None = None  # a LoRA adapter's base model


class LoraAdapter(Shape):
    object: Literal["lora_adapter"]
    lora_name: str
    parent: str | None = None
    rank: int | None = None
    owned_by: str | None = None
    deleted: bool | None = None


class ModelList(Shape):
    object: Literal["list"]
    data: list[ModelCard]
