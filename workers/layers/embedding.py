"""Vocab-parallel embedding and LM head: each rank holds a contiguous range of the vocab."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.parallel import TensorParallel


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        # Pad so that every rank holds the same number of rows; padded rows stay zero.
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.num_real_rows = max(0, min(vocab_size - self.vocab_start, self.rows_per_rank))
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, tensor_slice: Any, shard_id: Any = None) -> None:
        rows = tensor_slice[self.vocab_start : self.vocab_start + self.num_real_rows]
        if rows.shape[1] != param.shape[1] or tensor_slice.get_shape()[0] != self.vocab_size:
            raise ValueError(
                f"embedding: checkpoint shape {tuple(tensor_slice.get_shape())} != "
                f"({self.vocab_size}, {param.shape[1]})"
            )
        param.data[: self.num_real_rows].copy_(rows)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        # token_ids: [num_tokens] -> [num_tokens, hidden]
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        local_ids = token_ids - self.vocab_start
        is_mine = (local_ids >= 0) & (local_ids < self.num_real_rows)
        out = F.embedding(torch.where(is_mine, local_ids, 0), self.weight)
        out = out * is_mine.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits; each rank computes its vocab range, rank 0 gets them all."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # hidden: [num_seqs, hidden] -> logits: [num_seqs, vocab]
        local = F.linear(hidden, self.weight)
        logits = self.tp.all_gather_last_dim(local)
        return logits[:, : self.vocab_size]
