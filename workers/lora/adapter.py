"""An adapter's tensors, read from its PEFT safetensors file and checked against the base.

The file's bytes are kept whole, as one flat buffer (`LoraAdapter.data`), with where each A and B
lies in it: a slot load on CUDA copies that buffer to the device in one transfer and fills the
slot from views of it there (workers/lora/manager.py), instead of hundreds of small host copies.
The tensors stay in the file's dtype, whole (not this rank's slice: a slot load slices them);
the scaling is applied as B goes into its slot.
"""

from __future__ import annotations

import json
import os
import re
import struct
import time
from dataclasses import dataclass, field

import torch

from shared.errors import LoraAdapterError
from shared.lora_config import LoraConfig, projection_shapes
from shared.model_config import ModelConfig

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT drops the adapter's name
# when it saves; an older save may keep it: ...lora_A.default.weight).
_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
# safetensors' dtype names -> torch's (the floating ones: an adapter holds nothing else)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# The most a header may claim: safetensors' own limit (100 MB).
_MAX_HEADER = 100_000_000


@dataclass(frozen=True)
class TensorPlace:
    """Where one tensor lies in the file's bytes."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the whole file
    end: int

    def view(self, data: torch.Tensor) -> torch.Tensor:
        """The tensor, a view of `data` (the file's bytes, uint8, on any device)."""
        raw = data[self.start : self.end]
        if self.start % self.dtype.itemsize:  # safetensors does not promise aligned offsets
            raw = raw.clone()
        return raw.view(self.dtype).view(self.shape)


@dataclass
class LoraAdapter:
    name: str
    config: LoraConfig
    data: torch.Tensor  # the whole file's bytes, uint8
    # (layer index, PEFT projection name) -> where its A [rank, in] and B [out, rank] lie in data
    places: dict[tuple[int, str], tuple[TensorPlace, TensorPlace]] = field(default_factory=dict)
    load_ms: float = 0.0  # reading and checking the file

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def scaling(self) -> float:
        return self.config.scaling

    @property
    def num_bytes(self) -> int:
        return self.data.numel()

    def pairs(self, data: torch.Tensor | None = None) -> dict[tuple[int, str], tuple[torch.Tensor, ...]]:
        """(A, B) of every projection, views of `data` (default: the host copy; or the same
        bytes copied to a device), B unscaled."""
        data = self.data if data is None else data
        return {key: (a.view(data), b.view(data)) for key, (a, b) in self.places.items()}


def load_adapter(name: str, config: LoraConfig, base: ModelConfig) -> LoraAdapter:
    """Read the adapter's file; LoraAdapterError names the file and what is wrong with it."""
    start = time.perf_counter()
    path = config.weights_path
    data, header = _read_safetensors(path)
    shapes = projection_shapes(base)
    halves: dict[tuple[int, str], dict[str, TensorPlace]] = {}
    for tensor_name, place in header.items():
        match = _NAME.match(tensor_name)
        if match is None:
            raise _bad(path, f"tensor {tensor_name!r} is not a LoRA A or B of a layer projection")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if module not in config.target_modules:
            raise _bad(path, f"tensor {tensor_name!r} targets {module!r}, which adapter_config.json "
                             f"does not list (or this base lacks)")
        if layer >= base.num_layers:
            raise _bad(path, f"tensor {tensor_name!r}: the base has {base.num_layers} layers")
        out_features, in_features = shapes[module]
        expected = (config.rank, in_features) if half == "A" else (out_features, config.rank)
        if place.shape != expected:
            raise _bad(path, f"tensor {tensor_name!r} has shape {place.shape}, expected {expected} "
                             f"(rank {config.rank} on this base: another base model?)")
        halves.setdefault((layer, module), {})[half] = place
    adapter = LoraAdapter(name, config, data)
    for key, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise _bad(path, f"layer {key[0]} {key[1]} has lora_{''.join(pair)} without its pair")
        adapter.places[key] = (pair["A"], pair["B"])
    if not adapter.places:
        raise _bad(path, "holds no LoRA tensors")
    adapter.load_ms = (time.perf_counter() - start) * 1000
    return adapter


def _read_safetensors(path: str) -> tuple[torch.Tensor, dict[str, TensorPlace]]:
    """The file's bytes and its tensors' places, every place checked against the file's length
    (the format: an 8-byte little-endian header length, a JSON header, then the tensors' bytes)."""
    try:
        with open(path, "rb") as file:
            # torch.empty, not bytearray: no zero-fill of memory the read writes over
            data = torch.empty(os.fstat(file.fileno()).st_size, dtype=torch.uint8)
            raw = data.numpy()
            num_read = file.readinto(memoryview(raw))  # straight into the buffer: no second copy
        if num_read != len(raw):
            raise OSError(f"read {num_read} of its {len(raw)} bytes")
    except OSError as exc:
        raise _bad(path, f"unreadable safetensors ({exc})") from None
    if len(raw) < 8:
        raise _bad(path, f"unreadable safetensors (a file of {len(raw)} bytes)")
    (header_len,) = struct.unpack("<Q", raw[:8].tobytes())
    if header_len > min(_MAX_HEADER, len(raw) - 8):
        raise _bad(path, f"unreadable safetensors (a header of {header_len} bytes in a file of {len(raw)})")
    try:
        header = json.loads(raw[8 : 8 + header_len].tobytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(path, f"unreadable safetensors (its header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise _bad(path, "unreadable safetensors (its header is not a JSON object)")
    data_start = 8 + header_len
    places = {}
    for tensor_name, entry in header.items():
        if tensor_name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            dtype = _DTYPES[dtype_name]
            numel = 1
            for size in shape:
                numel *= int(size)
            is_whole = (0 <= begin <= end and data_start + end <= len(raw)
                        and end - begin == numel * dtype.itemsize)
        except (KeyError, TypeError, ValueError):
            raise _bad(path, f"unreadable safetensors (tensor {tensor_name!r}: {entry!r})") from None
        if not is_whole:
            raise _bad(path, f"unreadable safetensors (tensor {tensor_name!r} lies outside the file or "
                             f"has {end - begin} bytes for its shape {list(shape)})")
        places[tensor_name] = TensorPlace(dtype, shape, data_start + begin, data_start + end)
    return data, places


def _bad(path: str, problem: str) -> LoraAdapterError:
    return LoraAdapterError(f"LoRA adapter {path}: {problem}", param="lora_path")
