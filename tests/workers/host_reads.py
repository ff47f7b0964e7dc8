"""A CPU stand-in for CUDA's sync-debug mode: inside `no_host_reads()`, any torch call that on
CUDA would wait for the device (a tensor's values read on the host, a data-dependent shape, a
fresh pinned copy) raises. The launch path can then be checked on CPU, where the fixtures run
the graph code too; the CUDA test (tests/workers/test_pending_tokens.py) checks the real thing."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__,
    torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu,
    torch.Tensor.pin_memory, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select,
    torch.masked_select, torch.Tensor.unique, torch.unique, torch.Tensor.any, torch.Tensor.all,
}


class HostReadError(AssertionError):
    pass


class no_host_reads(TorchFunctionMode):  # noqa: N801 - used as a context manager, like a function
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            raise HostReadError(f"{getattr(func, '__name__', func)} reads the device on the host")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _has_mask(args[1]):
            raise HostReadError("indexing with a boolean mask sizes its result from the device")
        if func is torch.repeat_interleave and "output_size" not in kwargs:
            raise HostReadError("repeat_interleave without output_size sizes its result from the device")
        return func(*args, **kwargs)


def _has_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)
