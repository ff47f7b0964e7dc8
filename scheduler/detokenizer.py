"""Token ids in, streamable text out: incremental decoding and stop strings.

Decoding works like vLLM's and Hugging Face TGI's: keep a short window of token ids made of
the last emitted chunk (context) plus the ids not emitted yet, decode the window, and emit
what the new ids added beyond the context's text. The context is what lets tokenizers that
drop a word's leading space at the start of a decode (SentencePiece) get spaces right,
and the window stays a few tokens long, so each token costs O(1) decoding.

A decode that ends in U+FFFD may mean the last ids hold an incomplete UTF-8 character (its
remaining bytes come in later tokens): then nothing is emitted until it completes, or until
finish() flushes it, as a full decode would show it. Where the tokenizer's vocabulary gives each
token's bytes (shared/token_bytes.py), the last tokens' bytes say whether it can still complete:
bytes that no later byte can make valid (a lone continuation byte, a lead byte cut short by
another) are emitted as U+FFFD at once, as a full decode shows them. Held back, they stalled the
stream for as long as a model kept making such tokens: a random model over a vocabulary of
152,064 byte strings held back half of its tokens, in runs of up to 11.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from shared.token_bytes import exact_token_bytes_reader

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used as the first context (vLLM uses 5 too): enough for a decoder to see
# whether the first output token starts a new word.
NUM_PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes: whether the text's end can still complete is decided by
# its last 3 bytes, which lie within the last 4 tokens (each of at least one byte).
_MAX_CHAR_TOKENS = 4


@dataclass(frozen=True)
class _VocabularyBytes:
    """What the end-of-text check reads of a tokenizer: each token's bytes, and the special ids a
    decode skips (their bytes are not in the text: the bytes around them join)."""

    read: Callable[[int], bytes]
    special_ids: frozenset[int]


# tokenizer id -> (tokenizer, its bytes or None): reading a vocabulary's kind parses the
# tokenizer's whole definition, so it is done once per tokenizer, not per request.
_vocabulary_bytes: dict[int, tuple[object, _VocabularyBytes | None]] = {}


def _bytes_of(tokenizer) -> _VocabularyBytes | None:
    entry = _vocabulary_bytes.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        try:
            reader = exact_token_bytes_reader(tokenizer)
        except Exception:  # a tokenizer of another shape (a test double): hold back as before
            reader = None
        special = set(getattr(tokenizer, "all_special_ids", None) or [])
        special |= set(getattr(tokenizer, "added_tokens_decoder", None) or {})
        special |= set((getattr(tokenizer, "special_ids", None) or {}).values())  # Qwen v1's
        found = None if reader is None else _VocabularyBytes(reader, frozenset(special))
        entry = _vocabulary_bytes[id(tokenizer)] = (tokenizer, found)
    return entry[1]


def can_still_complete(tail: bytes) -> bool:
    """Whether these bytes end inside a valid UTF-8 character that more bytes can complete."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(tail, final=False)
    return bool(decoder.getstate()[0])


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer used here."""

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = ...,
        clean_up_tokenization_spaces: bool | None = ...,
    ) -> str: ...


def find_stop_string(
    text: str, stop: Sequence[str], num_new_chars: int
) -> tuple[int, str] | None:
    """The earliest stop string in text that ends within its last num_new_chars characters.

    Returns (index where it starts, the stop string), or None. Only the tail the new text
    could have completed is searched, so the cost does not grow with the output.
    """
    best: tuple[int, str] | None = None
    for stop_str in stop:
        search_from = max(0, len(text) - num_new_chars - len(stop_str) + 1)
        index = text.find(stop_str, search_from)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop_str)
    return best


def num_partial_stop_chars(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of text that is a proper beginning of some stop string."""
    longest = 0
    for stop_str in stop:
        for length in range(min(len(stop_str) - 1, len(text)), longest, -1):
            if text.endswith(stop_str[:length]):
                longest = length
                break
    return longest


class StopStringFilter:
    """Cuts streamed text at the first stop string, never letting part of one through.

    Text that could be the start of a stop string is held back until later text either
    completes the stop string (then it is dropped with it) or rules it out (then it is
    released). finish() releases whatever is still held back.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = list(stop)
        self.matched_stop: str | None = None
        # Received but not emitted: the longest tail that could start a stop string. A
        # match can only start here or in new text, so only this much is searched again.
        self._held_text = ""

    def add_text(self, delta: str) -> str:
        """Take new text; return the part that is safe to stream now."""
        if self.matched_stop is not None:
            raise RuntimeError(f"text added after stop string {self.matched_stop!r} matched")
        if not self.stop:
            return delta
        pending = self._held_text + delta
        match = find_stop_string(pending, self.stop, len(delta))
        if match is not None:
            index, self.matched_stop = match
            self._held_text = ""
            return pending[:index]
        num_held = num_partial_stop_chars(pending, self.stop)
        self._held_text = pending[len(pending) - num_held :]
        return pending[: len(pending) - num_held]

    def finish(self) -> str:
        """Release the held-back text: no more text is coming, so it cannot become a stop."""
        released, self._held_text = self._held_text, ""
        return released


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas, cut at its stop strings."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ) -> None:
        self._tokenizer = tokenizer
        # A fast tokenizer's Rust backend decodes the same text without the Python wrapper's
        # per-call work (a third of the cost per token, paid for every token streamed).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._skip_special_tokens = skip_special_tokens
        self._stop_filter = StopStringFilter(stop)
        self._vocabulary_bytes = _bytes_of(tokenizer)
        context_ids = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context_ids)
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character. Using it as context would make the first
            # output bytes complete that character in the prompt's text, and the output
            # would lose them; decode the output on its own instead.
            context_ids, context_text = [], ""
        # Window: the context (ids already turned into text) then ids not emitted yet.
        self._window_ids = context_ids
        self._num_context_ids = len(context_ids)
        self._context_text = context_text
        # Characters sent beyond the context's text while the window's last one is incomplete.
        self._num_sent_chars = 0

    @property
    def matched_stop(self) -> str | None:
        """The stop string the output ran into, once it has."""
        return self._stop_filter.matched_stop

    def add_token(self, token_id: int) -> str:
        """Take one output token; return the text that can be streamed now (maybe empty)."""
        return self._stop_filter.add_text(self._decode_next(token_id))

    def finish(self) -> str:
        """Flush an incomplete trailing character and held-back text at the end of output."""
        if self.matched_stop is not None:
            return ""  # everything after the stop string is dropped
        text = self._decode(self._window_ids)
        delta = text[len(self._context_text) + self._num_sent_chars :]
        self._advance_context()
        return self._stop_filter.add_text(delta) + self._stop_filter.finish()

    def _decode_next(self, token_id: int) -> str:
        self._window_ids.append(token_id)
        text = self._decode(self._window_ids)
        delta = text[len(self._context_text) + self._num_sent_chars :]
        if not delta:
            return ""  # no new text yet
        if delta.endswith(REPLACEMENT_CHAR) and self._may_complete():
            # Its last character is still arriving: what comes before it is final, so it goes
            # now; the window keeps its ids until the character completes.
            ready = delta[:-1]
            self._num_sent_chars += len(ready)
            return ready
        self._advance_context()
        return delta

    def _may_complete(self) -> bool:
        """Whether the U+FFFD ending the window's text may be a character still arriving."""
        vocabulary = self._vocabulary_bytes
        if vocabulary is None:
            return True  # unknown: wait, as a full decode would
        new_ids = self._window_ids[self._num_context_ids:]
        if self._skip_special_tokens:
            new_ids = [token_id for token_id in new_ids if token_id not in vocabulary.special_ids]
        tail = b"".join(vocabulary.read(token_id) for token_id in new_ids[-_MAX_CHAR_TOKENS:])
        return can_still_complete(tail)

    def _advance_context(self) -> None:
        """The ids just emitted become the context of the next decode."""
        self._window_ids = self._window_ids[self._num_context_ids :]
        self._num_context_ids = len(self._window_ids)
        self._context_text = self._decode(self._window_ids)
        self._num_sent_chars = 0

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        # No clean-up of tokenization spaces: it rewrites text around punctuation depending
        # on what follows, which an incremental decode cannot undo once streamed.
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
