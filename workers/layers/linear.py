"""Tensor-parallel linear layers, each carrying the `weight_loader` that reads its slice.

A weight loader gets a safetensors slice object (`safe_open(...).get_slice(name)`) and
reads only this rank's rows or columns from disk, never the whole tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.parallel import TensorParallel

# A safetensors PySafeSlice: indexable like a tensor, read lazily from the file.
TensorSlice = Any


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} != expected {tuple(param.shape)}")
    param.data.copy_(loaded)


class ReplicatedLinear(nn.Module):
    """Every rank holds the whole weight (small projections, TP=1)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, tensor_slice: TensorSlice, shard_id: Any = None) -> None:
        _copy_checked(param, tensor_slice[:], "replicated")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """Output features split over ranks: y_local = x @ W[rows of this rank].T; no collective."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.out_start, self.out_per_rank = tp.shard(out_features)
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, tensor_slice: TensorSlice, shard_id: Any = None) -> None:
        _copy_checked(param, tensor_slice[self.out_start : self.out_start + self.out_per_rank],
                      "column-parallel")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate+up).

    Each rank's weight is [shard0 of this rank; shard1 of this rank; ...].
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TensorParallel) -> None:
        nn.Module.__init__(self)
        self.tp = tp
        self.shards = [tp.shard(size) for size in out_sizes]  # (start, size) per projection
        self.out_per_rank = sum(size for _, size in self.shards)
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, tensor_slice: TensorSlice, shard_id: Any = None) -> None:
        index = int(shard_id)
        start, part = self.shards[index]
        offset = sum(size for _, size in self.shards[:index])
        _copy_checked(param.data[offset : offset + part], tensor_slice[start : start + part], "merged")


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections fused; each rank holds whole KV groups.

    A rank takes some KV heads and the query heads that attend to them, so grouped-query
    attention stays local. Layout per rank: [its q heads | its k heads | its v heads].
    """

    def __init__(
        self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
        tp: TensorParallel,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} attention heads do not group over {num_kv_heads} KV heads")
        group = num_heads // num_kv_heads
        kv_start, num_kv = tp.shard(num_kv_heads)  # in heads
        self.num_heads = num_kv * group  # this rank's
        self.num_kv_heads = num_kv
        self.head_dim = head_dim
        nn.Module.__init__(self)
        self.tp = tp
        # (start, size) in the checkpoint's q, k and v rows
        self.shards = [
            (kv_start * group * head_dim, self.num_heads * head_dim),
            (kv_start * head_dim, num_kv * head_dim),
            (kv_start * head_dim, num_kv * head_dim),
        ]
        self.out_per_rank = sum(size for _, size in self.shards)
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, hidden), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, tensor_slice: TensorSlice, shard_id: Any = None) -> None:
        super().weight_loader(param, tensor_slice, {"q": 0, "k": 1, "v": 2}[shard_id])


class RowParallelLinear(nn.Module):
    """Input features split over ranks; partial sums meet in one all-reduce at the end."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, *,
        in_shard: tuple[int, int] | None = None,
    ) -> None:
        """`in_shard`: (start, size) of this rank's input features when the caller decides
        them (attention output follows the heads QKVParallelLinear gave this rank)."""
        super().__init__()
        self.tp = tp
        self.in_start, self.in_per_rank = in_shard or tp.shard(in_features)
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        # The bias is added once, after the reduction, so only the full sum carries it.
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, tensor_slice: TensorSlice, shard_id: Any = None) -> None:
        if param.dim() == 1:  # bias: replicated
            _copy_checked(param, tensor_slice[:], "row-parallel bias")
            return
        start = self.in_start
        _copy_checked(param, tensor_slice[:, start : start + self.in_per_rank], "row-parallel")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y
