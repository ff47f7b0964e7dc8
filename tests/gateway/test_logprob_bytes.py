"""Logprobs of characters split over tokens (SmolLM2's byte-level BPE splits emoji and CJK):
each token's `bytes` are its own, so a choice's concatenated bytes are its text's UTF-8, and
completions' `text_offset` counts characters of that text, however the tokens come in deltas."""

from __future__ import annotations

import pytest

from gateway.api.openai.format import TextOffsets, chat_logprobs, completion_logprobs
from gateway.core.settings import ModelSpec
from gateway.tokens.models import ServedModel

TEXT = "héllo 😀 世界 🦙 €5"


@pytest.fixture(scope="module")
def served(smollm2) -> ServedModel:
    return ServedModel.load(ModelSpec.from_path(smollm2))


def entries_of(model: ServedModel, text: str) -> list:
    ids = model.tokenizer(text, add_special_tokens=False).input_ids
    assert model.decode(ids) == text
    return [[token_id, -0.5, [[token_id, -0.5]]] for token_id in ids]


def test_the_text_is_split_inside_characters(served) -> None:
    """(The premise: otherwise the other tests test nothing.)"""
    entries = entries_of(served, TEXT)
    assert any("\ufffd" in served.token_text(token_id) for token_id, _, _ in entries)


def test_chat_logprobs_bytes_are_the_texts_utf8(served) -> None:
    items = chat_logprobs(served, entries_of(served, TEXT), 1)
    assert b"".join(bytes(item["bytes"]) for item in items) == TEXT.encode()
    assert all(item["top_logprobs"][0]["bytes"] == item["bytes"] for item in items)


@pytest.mark.parametrize("split", [1, 2, 3, 5])
def test_completion_text_offsets_count_characters_across_deltas(served, split: int) -> None:
    entries = entries_of(served, TEXT)
    offsets = TextOffsets(len("echo: "))
    got = []
    for start in range(0, len(entries), split):  # as a stream's deltas bring them
        got += completion_logprobs(served, entries[start:start + split], 0, offsets)["text_offset"]
    expected = []
    for i in range(len(entries)):
        before = b"".join(served.token_bytes(t) for t, _, _ in entries[:i])
        expected.append(len("echo: ") + len(before.decode("utf-8", errors="ignore")))
    assert got == expected
    assert offsets.chars == len("echo: ") + len(TEXT)
    # The token that ends 😀 (its last byte alone) starts where 😀 does.
    last_byte_of_smiley = next(i for i, (t, _, _) in enumerate(entries) if served.token_bytes(t) == b"\x80")
    assert got[last_byte_of_smiley] == len("echo: ") + TEXT.index("😀")


def test_a_tokenizer_that_lists_its_bytes_is_asked(tmp_path) -> None:
    """Qwen v1's tiktoken tokenizer (no byte-level table): bytes from its own list; a special
    token's are its text's."""
    from shared.tokenizer import load_tokenizer
    from testkit.qwen_checkpoints import synthetic_ranks, write_tiktoken

    write_tiktoken(tmp_path / "qwen.tiktoken", synthetic_ranks(900))
    (tmp_path / "tokenizer_config.json").write_text(
        '{"auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", null]}}')
    model = ServedModel("qwen", str(tmp_path), load_tokenizer(tmp_path), 2048, 1108)
    ids = model.tokenizer.encode_plain(TEXT)
    assert any("\ufffd" in model.token_text(token_id) for token_id in ids)
    items = chat_logprobs(model, [[token_id, -0.5, None] for token_id in ids], 0)
    assert b"".join(bytes(item["bytes"]) for item in items) == TEXT.encode()
    assert model.token_bytes(900) == b"<|endoftext|>"
