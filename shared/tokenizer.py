"""A model folder's Hugging Face tokenizer, for the engine and the gateway alike.

It lives below both so that a gateway loads a tokenizer without importing the engine, whose
module pulls in the worker code (and torch) with it.
"""

from __future__ import annotations

from pathlib import Path

from shared.errors import ModelLoadError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(folder: str | Path):
    """The model folder's Hugging Face tokenizer (with its chat template), or None."""
    from transformers import AutoTokenizer

    # transformers builds an empty tokenizer from config.json alone; that is no tokenizer.
    if not any((Path(folder) / name).exists() for name in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {str(folder)!r}: {exc}") from None


def encode_ids(tokenizer, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """`tokenizer(text).input_ids`, through the Rust backend of a fast tokenizer when there is
    one: the backend releases the GIL while it works, and the Python wrapper around it held
    the GIL for a third of the call (a gateway tokenizes on a thread beside its event loop,
    which would otherwise stall for that share of every prompt)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer(text, add_special_tokens=add_special_tokens).input_ids
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
