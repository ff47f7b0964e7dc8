"""A token's own bytes (logprobs' `bytes`): the concatenated bytes of a choice's tokens are its
text's UTF-8, even where one character is split over several tokens (each piece of it has
part of the character's bytes; decoding the piece alone would give U+FFFD).

Read from the tokenizer's vocabulary: a tokenizer that lists its tokens' bytes itself (Qwen v1's
tiktoken one, shared/qwen_tokenizer.py) is asked; a byte-level BPE (GPT-2's byte-to-character table:
SmolLM2, Llama 3, Qwen) maps each character of a token back to its byte; a SentencePiece-style
vocabulary spells a space "▁" and a lone byte "<0xNN>". A special or added token, and any
vocabulary of another kind, is its decoded text's UTF-8.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

_SENTENCEPIECE_SPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable Latin-1 bytes stand for themselves,
    every other byte for the character 256 + its rank among those others."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + rank): b for rank, b in enumerate(others)})
    return table


_BYTE_OF_CHAR = _byte_level_table()


def _decoder_types(tokenizer: Any) -> set[str]:
    """The types of the fast tokenizer's decoder and of the decoders in its sequence."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders") or [decoder]
    return {part.get("type", "") for part in parts if isinstance(part, dict)}


def token_bytes_reader(tokenizer: Any) -> Callable[[int], bytes]:
    """token id -> its bytes, for this tokenizer's kind of vocabulary."""
    reader = exact_token_bytes_reader(tokenizer)
    return reader if reader is not None else (lambda token_id: tokenizer.decode([token_id]).encode())


def exact_token_bytes_reader(tokenizer: Any) -> Callable[[int], bytes] | None:
    """token id -> its bytes where the vocabulary spells them (a piece of a character included);
    None for a vocabulary of another kind, whose tokens are known only by their decoded text."""
    if callable(getattr(tokenizer, "token_bytes", None)):
        listed = tokenizer.token_bytes()  # (a special token's is empty: its text is used)
        return lambda token_id: (listed[token_id] if 0 <= token_id < len(listed) and listed[token_id]
                                 else tokenizer.decode([token_id]).encode())
    kinds = _decoder_types(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})

    def decoded(token_id: int) -> bytes:
        return tokenizer.decode([token_id]).encode()

    def byte_level(token_id: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if token_id in special or not isinstance(piece, str) or any(c not in _BYTE_OF_CHAR for c in piece):
            return decoded(token_id)
        return bytes(_BYTE_OF_CHAR[c] for c in piece)

    def sentencepiece(token_id: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if token_id in special or not isinstance(piece, str):
            return decoded(token_id)
        lone_byte = _BYTE_TOKEN.match(piece)
        if lone_byte is not None:
            return bytes([int(lone_byte.group(1), 16)])
        return piece.replace(_SENTENCEPIECE_SPACE, " ").encode()

    if "ByteLevel" in kinds:
        return byte_level
    if "ByteFallback" in kinds or "Metaspace" in kinds:
        return sentencepiece
    return None
