"""Device and dtype follow the hardware unless the caller says otherwise."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class HardwareDefaults:
    max_num_seqs: int  # running sequences (and the largest CUDA-graph decode batch)
    max_num_batched_tokens: int  # tokens per step


def hardware_defaults(device: torch.device) -> HardwareDefaults:
    """Engine limits a command takes when no flag sets them. On a GPU, decode throughput keeps
    growing up to ~512 sequences per step (scripts/bench_gpu.py, H200: 10.1k output tok/s at
    512 against 7.9k at 256); a CPU is saturated long before."""
    if device.type == "cuda":
        return HardwareDefaults(max_num_seqs=512, max_num_batched_tokens=8192)
    return HardwareDefaults(max_num_seqs=256, max_num_batched_tokens=2048)
