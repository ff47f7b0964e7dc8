"""docs/configuration.md's list of what the gateway accepts names every field the request
schemas accept (and nothing else is accepted: extra="forbid"), so the list and the code agree."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from gateway.api.openai.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from gateway.api.requests.schemas import SubmitChat

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"## {title}")
    return text[start:text.index("\n## ", start + 1)]


def _fields(schema: type[BaseModel]) -> set[str]:
    return {field.alias or name for name, field in schema.model_fields.items()}


def test_every_accepted_field_is_listed() -> None:
    listed = set(re.findall(r"`([a-z_]+)", _section("What the gateway accepts")))
    accepted = _fields(ChatCompletionRequest) | _fields(CompletionRequest) | _fields(ChatMessage)
    assert accepted - listed == set()
    submit_section = _section("What the gateway accepts").split("### Submit and poll")[1]
    submit = set(re.findall(r"`([a-z_]+)", submit_section))
    assert _fields(SubmitChat) - _fields(ChatCompletionRequest) - submit == set()
    assert all(schema.model_config["extra"] == "forbid"
               for schema in (ChatCompletionRequest, CompletionRequest, ChatMessage, SubmitChat))
