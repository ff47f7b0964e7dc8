"""Device and dtype follow the hardware unless the caller says otherwise (the engine limits that
follow it are shared/config.py's DEVICE_DEFAULTS)."""

from __future__ import annotations

import torch

from shared.errors import InvalidRequestError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError(f"device {name!r} was asked for but CUDA is not available", param="device")
    return torch.device(name)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise InvalidRequestError(f"dtype {name!r} is not one of {', '.join(DTYPES)}", param="dtype")
    return DTYPES[name]


def place_rank(device_name: str | None, dtype_name: str | None, rank: int,
               num_threads: int | None = None) -> tuple[torch.device, torch.dtype]:
    """A rank's device (on CUDA without an index: GPU rank mod the visible count, made current)
    and dtype; on a CPU, torch's threads when `num_threads` is set."""
    device = resolve_device(device_name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if num_threads and device.type == "cpu":
        torch.set_num_threads(num_threads)
    return device, resolve_dtype(dtype_name, device)
