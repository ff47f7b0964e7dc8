"""A model folder's Hugging Face tokenizer, for the engine and the gateway alike.

It lives below both so that a gateway loads a tokenizer without importing the engine, whose
module pulls in the worker code (and torch) with it.
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.errors import ModelLoadError
from shared.qwen_tokenizer import TIKTOKEN_FILE, QwenTokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(folder: str | Path):
    """The model folder's tokenizer (with its chat template), or None: Qwen (v1)'s from its
    qwen.tiktoken (its folder's QWenTokenizer is remote code, never run), else Hugging Face's."""
    from transformers import AutoTokenizer

    if _is_qwen_tiktoken(Path(folder)):
        return QwenTokenizer.from_folder(folder)

    # transformers builds an empty tokenizer from config.json alone; that is no tokenizer.
    if not any((Path(folder) / name).exists() for name in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {str(folder)!r}: {exc}") from None


def _is_qwen_tiktoken(folder: Path) -> bool:
    """A folder tokenized by qwen.tiktoken: it has the file, or its tokenizer_config.json names
    QWenTokenizer (then the missing file is an error, not a folder without a tokenizer)."""
    if (folder / TIKTOKEN_FILE).exists():
        return True
    path = folder / "tokenizer_config.json"
    try:
        tokenizer_config = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    auto_map = tokenizer_config.get("auto_map") or {}
    names = [tokenizer_config.get("tokenizer_class"), *(auto_map.get("AutoTokenizer") or [])]
    return any(isinstance(name, str) and "QWenTokenizer" in name for name in names)


def encode_ids(tokenizer, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """`tokenizer(text).input_ids`, through the Rust backend of a fast tokenizer when there is
    one: the backend releases the GIL while it works, and the Python wrapper around it held
    the GIL for a third of the call (a gateway tokenizes on a thread beside its event loop,
    which would otherwise stall for that share of every prompt)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer(text, add_special_tokens=add_special_tokens).input_ids
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
