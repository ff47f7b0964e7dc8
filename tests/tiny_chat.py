"""A tiny random llama (2 layers, hidden 64) with SmolLM2's vocabulary, tokenizer and chat
template: a whole fleet on it costs milliseconds per step, so fleet tests measure the fleet."""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def make_tiny_chat_model(folder: Path, smollm2: Path) -> Path:
    from workers.checkpoints import make_tiny_checkpoint

    with contextlib.redirect_stderr(io.StringIO()):
        make_tiny_checkpoint("llama", folder, vocab_size=49152, num_hidden_layers=2,
                             max_position_embeddings=4096)
    for name in TOKENIZER_FILES:
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, folder / name)
    return folder
