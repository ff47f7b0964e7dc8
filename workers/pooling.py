"""Final hidden states -> one vector per input: CLS, mean or last token, then L2 normalization.

A decoder's input may arrive in several prefill chunks (the scheduler's token budget cuts it;
its K/V stays in the cache between them), so pooling is kept per request across chunks: the
first row (CLS) of its first chunk, the running sum of its rows (mean), and the last row of its
last chunk. A chunk at position 0 starts the request afresh (a preempted request recomputes
from there). Sums are kept in float32 whatever the serving dtype.

The rows' indices go up through the runner's pinned staging ring (`upload`): a tensor made from a
Python list on CUDA is a pageable copy, which waits for the stream's work before it, so the step
ahead's pooling would wait for its own forward.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from shared.pooling_config import PoolingConfig, PoolingType


class ChunkPooler:
    """Pools rows of packed sequences, carrying partial results of a request between chunks."""

    def __init__(self, config: PoolingConfig) -> None:
        self.config = config
        self._partial: dict[str, torch.Tensor] = {}  # req_id -> first row (CLS) or row sum (MEAN)

    def forget(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._partial.pop(req_id, None)

    def pool(self, hidden: torch.Tensor, req_ids: list[str], row_starts: list[int], lens: list[int],
             start_positions: list[int], is_last: list[bool],
             upload: Callable[[np.ndarray], torch.Tensor]) -> tuple[list[str], torch.Tensor | None]:
        """Pool the chunks of one step. hidden: [num_tokens, hidden]; chunk i owns rows
        [row_starts[i], row_starts[i] + lens[i]) and starts at position start_positions[i] of its
        input; is_last[i]: it ends the input; upload: int64 host array -> device tensor. Returns
        the requests that ended and their vectors ([num_ended, hidden] float32, normalized when
        the model normalizes), None when none ended."""
        kind = self.config.pooling_type
        starts, sizes = np.asarray(row_starts, dtype=np.int64), np.asarray(lens, dtype=np.int64)
        if kind is PoolingType.LAST:
            chunk_vectors = hidden[upload(starts + sizes - 1)].float()
        elif kind is PoolingType.CLS:
            chunk_vectors = hidden[upload(starts)].float()
        else:
            segment = upload(np.repeat(np.arange(len(sizes), dtype=np.int64), sizes))
            chunk_vectors = torch.zeros(len(lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
            chunk_vectors.index_add_(0, segment, hidden.float())
        ended: list[str] = []
        vectors: list[torch.Tensor] = []
        for i, req_id in enumerate(req_ids):
            vector = chunk_vectors[i]
            if start_positions[i] > 0 and kind is not PoolingType.LAST:
                carried = self._partial.pop(req_id)
                vector = carried if kind is PoolingType.CLS else carried + vector
            if not is_last[i]:
                if kind is not PoolingType.LAST:
                    self._partial[req_id] = vector
                continue
            if kind is PoolingType.MEAN:
                vector = vector / (start_positions[i] + lens[i])
            ended.append(req_id)
            vectors.append(vector)
        if not ended:
            return [], None
        stacked = torch.stack(vectors)  # [num_ended, hidden]
        return ended, F.normalize(stacked, dim=-1) if self.config.normalize else stacked
