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
        self.out_per_rank = out_features // tp.size
        tp.shard_range(out_features)  # raises when it does not divide
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, tensor_slice: TensorSlice, shard_id: Any = None) -> None:
        start = self.tp.rank * self.out_per_rank
        _copy_checked(param, tensor_slice[start : start + self.out_per_rank], "column-parallel")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate+up).

    Each rank's weight is [shard0 of this rank; shard1 of this rank; ...].
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, sum(out_sizes), bias, tp)
        for size in out_sizes:
            tp.shard_range(size)
        self.out_sizes_per_rank = [size // tp.size for size in out_sizes]

    def weight_loader(self, param: nn.Parameter, tensor_slice: TensorSlice, shard_id: Any = None) -> None:
        index = int(shard_id)
        part = self.out_sizes_per_rank[index]
        offset = sum(self.out_sizes_per_rank[:index])
        start = self.tp.rank * part
        _copy_checked(param.data[offset : offset + part], tensor_slice[start : start + part], "merged")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; each rank holds its own heads of each.

    Layout per rank: [q heads of this rank | k heads of this rank | v heads of this rank].
    """

    def __init__(
        self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
        tp: TensorParallel,
    ) -> None:
        if num_heads % tp.size or num_kv_heads % tp.size:
            raise ValueError(
                f"{num_heads} attention heads / {num_kv_heads} KV heads do not divide by "
                f"tensor-parallel size {tp.size}"
            )
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = num_kv_heads // tp.size
        self.head_dim = head_dim
        total = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden, total, bias, tp)

    def weight_loader(self, param: nn.Parameter, tensor_slice: TensorSlice, shard_id: Any = None) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, part = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[
            shard_id
        ]
        start = self.tp.rank * part
        _copy_checked(param.data[offset : offset + part], tensor_slice[start : start + part], "qkv")


class RowParallelLinear(nn.Module):
    """Input features split over ranks; partial sums meet in one all-reduce at the end."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        tp.shard_range(in_features)
        self.in_per_rank = in_features // tp.size
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        # The bias is added once, after the reduction, so only the full sum carries it.
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, tensor_slice: TensorSlice, shard_id: Any = None) -> None:
        if param.dim() == 1:  # bias: replicated
            _copy_checked(param, tensor_slice[:], "row-parallel bias")
            return
        start = self.tp.rank * self.in_per_rank
        _copy_checked(param, tensor_slice[:, start : start + self.in_per_rank], "row-parallel")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y
