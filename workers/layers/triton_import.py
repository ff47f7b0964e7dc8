"""Triton where it is installed (the CUDA builds). On a CPU-only install `triton` and `tl` are
None and every layer takes its PyTorch path; `is_available(x)` says which path a tensor takes."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch paths are used instead
    triton = tl = None


def is_available(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run for a tensor: Triton installed and the tensor on CUDA."""
    return triton is not None and x.is_cuda
