"""A chat's ids from the ids of its pieces: the text between added tokens, each encoded once.

Chats of one app repeat one long system prompt; encoding it again for every request was most
of plan_chat's time (issue 27). A Hugging Face fast tokenizer splits its input on its added
tokens (`<|im_start|>`...) first, and normalizes, pre-tokenizes and encodes each piece between
them alone (tokenizers' AddedVocabulary, extract_and_normalize): so without special tokens
added around it, a text's ids are its pieces' ids and the added tokens' ids, in order. Each
piece's ids are kept (an LRU by its text, bounded in bytes), and only the new pieces encoded.

That holds by construction only for some tokenizers, so `for_tokenizer` checks at load and
answers None for any other (the caller then encodes the whole text):
- the added tokens match as plain strings: no lstrip, rstrip or single_word; each one either
  matched before normalization (normalized=False) or the tokenizer has no normalizer;
  `encode_special_tokens` off (when on, they are not split out at all);
- nothing sees past a piece: a normalizer from PER_PIECE_NORMALIZERS (or none), pre-tokenizers
  from PER_PIECE_PRE_TOKENIZERS (Metaspace, say, prepends "▁" to the input's first piece only),
  a BPE model without dropout (random), no truncation or padding.
The byte-level BPE families (GPT-2, Llama-3, Qwen2, SmolLM2) pass.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections import OrderedDict
from typing import Any

PER_PIECE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD"}
PER_PIECE_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit"}
MAX_CACHE_BYTES = 16 << 20  # per tokenizer and process: some hundreds of long system prompts
ID_BYTES = 36  # what one id costs in a cached list (a pointer and an int object)


def _splitter(tokens: list[str]) -> re.Pattern | None:
    """Splits on these tokens, keeping them: at each place the longest that matches, as
    tokenizers' own leftmost-longest matcher picks. None for no tokens."""
    if not tokens:
        return None
    return re.compile("(" + "|".join(map(re.escape, sorted(tokens, key=len, reverse=True))) + ")")


def _types(component: dict | None) -> list[str]:
    """The types of a (possibly Sequence) normalizer or pre-tokenizer."""
    if component is None:
        return []
    inner = component.get("normalizers") or component.get("pretokenizers")
    if component.get("type") == "Sequence" and inner is not None:
        return [t for part in inner for t in _types(part)]
    return [str(component.get("type"))]


def splits_on_added_tokens(backend: Any) -> bool:
    """Whether this tokenizers.Tokenizer encodes a text as the concatenation of its pieces'
    encodings (see the module's docstring)."""
    config = json.loads(backend.to_str())
    normalizer, model = config.get("normalizer"), config.get("model") or {}
    if getattr(backend, "encode_special_tokens", False) or config.get("truncation") or config.get("padding"):
        return False
    if not set(_types(normalizer)) <= PER_PIECE_NORMALIZERS:
        return False
    if not set(_types(config.get("pre_tokenizer"))) <= PER_PIECE_PRE_TOKENIZERS:
        return False
    if model.get("type") != "BPE" or model.get("dropout") not in (None, 0.0):
        return False
    return all(not (token.lstrip or token.rstrip or token.single_word)
               and (normalizer is None or not token.normalized)
               for token in backend.get_added_tokens_decoder().values())


class PieceEncoder:
    def __init__(self, backend: Any, *, max_bytes: int = MAX_CACHE_BYTES) -> None:
        self.backend = backend
        tokens = [t for t in backend.get_added_tokens_decoder().items() if t[1].content]
        self._added = {token.content: token_id for token_id, token in tokens}  # its text -> its id
        # tokenizers splits on the tokens matched before normalization first, then each piece
        # on the others: two passes here too (with a normalizer, every token is of the first).
        self._splitters = [_splitter([t.content for _, t in tokens if t.normalized == normalized])
                           for normalized in (False, True)]
        self.max_bytes = max_bytes
        self._cache: OrderedDict[str, list[int]] = OrderedDict()  # piece -> its ids, least recent first
        self._bytes = 0
        self._lock = threading.Lock()
        self.misses = 0  # pieces encoded

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, **kwargs) -> PieceEncoder | None:
        """An encoder for this Hugging Face tokenizer, or None when its encodings are not
        their pieces' by construction (or it has no Rust backend, or no added tokens)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or not backend.get_added_tokens_decoder() or not splits_on_added_tokens(backend):
            return None
        return cls(backend, **kwargs)

    def split(self, text: str) -> list[str]:
        """text, token, text, token, ..., text: what tokenizers encodes apart (texts may be '')."""
        parts = [text]
        for splitter in self._splitters:
            if splitter is not None:
                parts = [p for index, part in enumerate(parts)
                         for p in ([part] if index % 2 else splitter.split(part))]
        return parts

    def encode(self, text: str) -> list[int]:
        """encode_ids(tokenizer, text, add_special_tokens=False), exactly."""
        parts = self.split(text)
        known: dict[str, list[int]] = {}  # this text's pieces -> their ids
        with self._lock:  # (the batch ingester's threads encode too)
            for piece in parts[::2]:
                if piece and piece not in known and (ids := self._cache.get(piece)) is not None:
                    self._cache.move_to_end(piece)
                    known[piece] = ids
        new = [piece for piece in dict.fromkeys(parts[::2]) if piece and piece not in known]
        if new:  # one call: the backend encodes them side by side, without the GIL
            for piece, encoding in zip(new, self.backend.encode_batch(new, add_special_tokens=False),
                                       strict=True):
                known[piece] = encoding.ids
            with self._lock:
                self.misses += len(new)
                for piece in new:
                    self._put(piece, known[piece])
        ids: list[int] = []
        for index, part in enumerate(parts):
            if index % 2:
                ids.append(self._added[part])
            elif part:
                ids += known[part]
        return ids

    def _put(self, piece: str, ids: list[int]) -> None:
        if piece in self._cache:  # (another thread put it meanwhile)
            return
        cost = sys.getsizeof(piece) + ID_BYTES * len(ids)
        if cost > self.max_bytes:
            return
        self._cache[piece] = ids
        self._bytes += cost
        while self._bytes > self.max_bytes:
            old_piece, old_ids = self._cache.popitem(last=False)
            self._bytes -= sys.getsizeof(old_piece) + ID_BYTES * len(old_ids)
