"""Tensor-parallel linear layers, each carrying the `weight_loader` that reads its slice.

A weight loader gets a safetensors slice object (`safe_open(...).get_slice(name)`) and
reads only this rank's rows or columns from disk, never the whole tensor.

Every layer here may hold a quantized weight (workers/layers/quantization.py): then it also
holds `weight_scale`, one scale per output row, filled either by quantizing the rows it loads
(online) or from a pre-quantized checkpoint's own `weight_scale` tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers.fp8 import QuantizedActivation
from workers.layers.quantization import WeightQuantization, method_being_built
from workers.parallel import TensorParallel

# A safetensors PySafeSlice: indexable like a tensor, read lazily from the file.
TensorSlice = Any


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} != expected {tuple(param.shape)}")
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    """Holds the weight [out, in] (and maybe a bias [out]) in the serving dtype or quantized."""

    quant: WeightQuantization | None

    def _make_params(self, out_features: int, in_features: int, bias: bool) -> None:
        self.quant = method_being_built()
        dtype = self.quant.storage_dtype if self.quant else None  # None: the default dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        if self.quant:
            self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32),
                                             requires_grad=False)
            self.quant.register(self.weight, self.weight_scale)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def _store(self, param: nn.Parameter, rows: slice, loaded: torch.Tensor, name: str) -> None:
        """Write checkpoint data into rows `rows` of `param` (dim 0)."""
        if param is self.weight and self.quant and loaded.dtype != self.quant.storage_dtype:
            # A full-precision checkpoint: quantize this slice's rows as they arrive.
            quantized, scale = self.quant.quantize_rows(loaded)
            _copy_checked(param.data[rows], quantized, name)
            self.weight_scale.data[rows].copy_(scale)
            self.scale_computed = True  # weight_loader's completeness check needs no file scale
            return
        if param is getattr(self, "weight_scale", None):
            loaded = loaded.reshape(-1)  # compressed-tensors writes channel scales as [out, 1]
        _copy_checked(param.data[rows], loaded, name)

    def takes_fp8_input(self, x: torch.Tensor) -> bool:
        """Whether this layer wants x [num_tokens, in] as a QuantizedActivation (its FP8 product
        runs on e4m3 activations): the kernel before it then fuses the quant."""
        return self.quant is not None and self.quant.takes_fp8_input(x, self.weight)

    def _matmul(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        if self.quant:
            return self.quant.linear(x, self.weight, self.weight_scale)
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        return y + self.bias if self.bias is not None else y


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks: y_local = x @ W[rows of this rank].T; no collective."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.out_start, self.out_per_rank = tp.shard(out_features)
        self._make_params(self.out_per_rank, in_features, bias)

    def weight_loader(self, param: nn.Parameter, tensor_slice: TensorSlice, shard_id: Any = None) -> None:
        self._store(param, slice(None), tensor_slice[self.out_start : self.out_start + self.out_per_rank],
                    "column-parallel")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate+up).

    Each rank's weight is [shard0 of this rank; shard1 of this rank; ...].
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TensorParallel) -> None:
        nn.Module.__init__(self)
        self.tp = tp
        self.shards = [tp.shard(size) for size in out_sizes]  # (start, size) per projection
        self.out_per_rank = sum(size for _, size in self.shards)
        self._make_params(self.out_per_rank, in_features, bias)

    def weight_loader(self, param: nn.Parameter, tensor_slice: TensorSlice, shard_id: Any = None) -> None:
        index = int(shard_id)
        start, part = self.shards[index]
        offset = sum(size for _, size in self.shards[:index])
        self._store(param, slice(offset, offset + part), tensor_slice[start : start + part], "merged")


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
        # whole q, k and v rows in a checkpoint that stacks them (c_attn)
        self.full_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self._make_params(self.out_per_rank, hidden, bias)

    def weight_loader(self, param: nn.Parameter, tensor_slice: TensorSlice, shard_id: Any = None) -> None:
        if shard_id == "qkv":  # q, k and v stacked in one tensor (Qwen v1's c_attn): each rank's rows
            self._load_stacked(param, tensor_slice)
            return
        super().weight_loader(param, tensor_slice, {"q": 0, "k": 1, "v": 2}[shard_id])

    def _load_stacked(self, param: nn.Parameter, tensor_slice: TensorSlice) -> None:
        shape = tensor_slice.get_shape()
        if shape[0] != sum(self.full_sizes):
            raise ValueError(f"stacked q/k/v: checkpoint has {shape[0]} rows, "
                             f"expected {sum(self.full_sizes)}")
        file_offset = 0  # where q, then k, then v start in the stacked tensor
        our_offset = 0  # where they start in this rank's [q | k | v]
        for (start, part), full in zip(self.shards, self.full_sizes, strict=True):
            rows = tensor_slice[file_offset + start : file_offset + start + part]
            self._store(param, slice(our_offset, our_offset + part), rows, "stacked q/k/v")
            file_offset += full
            our_offset += part


class RowParallelLinear(LinearBase):
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
        # The bias is added once, after the reduction, so only the full sum carries it.
        self._make_params(out_features, self.in_per_rank, bias)

    def weight_loader(self, param: nn.Parameter, tensor_slice: TensorSlice, shard_id: Any = None) -> None:
        if param.dim() == 1:  # bias, or a pre-quantized file's per-row scales: whole on every rank
            self._store(param, slice(None), tensor_slice[:], "row-parallel bias or scale")
            return
        start = self.in_start
        # Online quantization scales this rank's columns only: each rank's partial sum is
        # dequantized before the all-reduce adds them.
        self._store(param, slice(None), tensor_slice[:, start : start + self.in_per_rank], "row-parallel")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self._matmul(x))
        return y + self.bias if self.bias is not None else y
