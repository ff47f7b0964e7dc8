"""What a pooling request asks beyond its tokens, and the embedding's last touches on the host.

`PoolingParams` travels with an embedding request (protocol/messages.py) to the engine, which
cuts the runner's vector to `dimensions` (Matryoshka: the leading dimensions, re-normalized when
the model normalizes). Checked at the edge against the model (PoolingConfig.check_dimensions).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.sampling import SamplingParams

RUNNERS = ("generate", "pooling")  # --runner, vLLM's spelling

# A pooling request ends after its prefill: the scheduler sees one (placeholder) token.
POOLING_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@dataclass(frozen=True)
class PoolingParams:
    task: str = "embed"
    dimensions: int | None = None  # keep the leading dimensions only (None: all)


def finish_embedding(raw: bytes, dimensions: int | None, normalize: bool) -> bytes:
    """The runner's float32 vector (bytes) cut to `dimensions`, re-normalized when `normalize`."""
    if dimensions is None:
        return raw
    vector = np.frombuffer(raw, dtype=np.float32)[:dimensions]
    if normalize:
        norm = float(np.linalg.norm(vector))
        vector = vector / max(norm, 1e-12)
    return vector.astype(np.float32).tobytes()


def embedding_from_bytes(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.float32)
