"""The answer of /v1/embeddings (and of a Batch API `/v1/embeddings` line), as OpenAI shapes it."""

from __future__ import annotations

import base64

import numpy as np


def embedding_item(index: int, vector_b64: str, encoding_format: str) -> dict:
    """One input's entry; the vector as stored (base64 of float32), or as floats."""
    if encoding_format == "base64":
        value: object = vector_b64
    else:
        value = np.frombuffer(base64.b64decode(vector_b64), dtype=np.float32).tolist()
    return {"object": "embedding", "index": index, "embedding": value}


def embedding_list(model: str, vectors_b64: list[str], encoding_format: str, prompt_tokens: int) -> dict:
    return {"object": "list",
            "data": [embedding_item(i, v, encoding_format) for i, v in enumerate(vectors_b64)],
            "model": model, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
