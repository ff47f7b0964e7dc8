"""The FP8 KV cache (--kv-cache-dtype fp8) on the PyTorch path: twice bf16's blocks in the same
bytes, e4m3 storage, and logits that track a full-precision cache when steps read it back."""

from __future__ import annotations

import random

import pytest
import torch

from shared.config import EngineConfig
from shared.errors import ModelLoadError
from shared.sampling import SamplingParams
from shared.step import SequenceWork, StepBatch
from workers.layers.fp8 import FP8_DTYPE
from workers.model_runner import ModelRunner
from workers.parallel import SINGLE_DEVICE

GREEDY = SamplingParams(temperature=0.0)


def _runner(folder, **config) -> ModelRunner:
    config = {"dtype": "float32", "num_kv_blocks": 32, "block_size": 4, **config}
    return ModelRunner(EngineConfig(model=str(folder), **config), SINGLE_DEVICE)


@pytest.mark.parametrize(("dtype", "ratio"), [("bfloat16", 2), ("float32", 4)])
def test_an_fp8_kv_cache_holds_twice_the_blocks_of_bf16_in_the_same_bytes(dtype, ratio, tiny_checkpoints):
    budget = 4 << 20  # a CPU budget: on a CUDA host the cache would be sized from the GPU's free memory
    full = _runner(tiny_checkpoints["llama"], dtype=dtype, num_kv_blocks=None, kv_cache_bytes_cpu=budget,
                   device="cpu")
    fp8 = _runner(tiny_checkpoints["llama"], dtype=dtype, num_kv_blocks=None, kv_cache_bytes_cpu=budget,
                  kv_cache_dtype="fp8", device="cpu")
    assert fp8.kv_caches.dtype == FP8_DTYPE and full.kv_caches.dtype == full.dtype
    assert fp8.kv_block_bytes * ratio == full.kv_block_bytes
    assert fp8.num_kv_blocks >= 0.95 * ratio * full.num_kv_blocks  # the scratch block aside
    assert fp8.kv_cache_bytes <= budget


def test_an_unknown_kv_cache_dtype_is_refused_by_name(tiny_checkpoints) -> None:
    with pytest.raises(ModelLoadError, match="kv_cache_dtype must be 'auto' or 'fp8', got 'int4'"):
        _runner(tiny_checkpoints["llama"], kv_cache_dtype="int4")


def _logits_of_steps(runner: ModelRunner, prompt: list[int], next_ids: list[int]) -> list[torch.Tensor]:
    """A prompt in two prefill chunks (the second attends over the cached first), then decodes
    of next_ids one at a time: the logits of every sampled step."""
    split = 2 * runner.block_size + 1  # the second chunk starts inside a block
    blocks = list(range(-(-(len(prompt) + len(next_ids)) // runner.block_size)))
    first = SequenceWork("r", prompt[:split], 0, blocks, False, GREEDY)
    runner.forward(StepBatch(0, [first]), use_graphs=False)
    steps = [SequenceWork("r", prompt[split:], split, blocks, True, GREEDY)]
    steps += [SequenceWork("r", [t], len(prompt) + i, blocks, True, GREEDY) for i, t in enumerate(next_ids)]
    return [runner.forward(StepBatch(i + 1, [w]), use_graphs=False)[0].float() for i, w in enumerate(steps)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp8_kv_logits_track_a_full_precision_cache(arch: str, tiny_checkpoints) -> None:
    """Each stored element rounds with relative error <= 2^-4 (e4m3's 3 mantissa bits), about
    3.6% RMS; attention averages over the keys, so the logits move by a few percent
    (the bound is 2x the largest we measured on these random models: 6.2%; their logits are small
    and flat, so relative errors read large)."""
    rng = random.Random(arch)
    prompt = [rng.randrange(3, 512) for _ in range(37)]
    next_ids = [rng.randrange(3, 512) for _ in range(4)]
    full = _logits_of_steps(_runner(tiny_checkpoints[arch]), prompt, next_ids)
    fp8 = _logits_of_steps(_runner(tiny_checkpoints[arch], kv_cache_dtype="fp8"), prompt, next_ids)
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(fp8, full, strict=True)]
    assert max(errors) < 0.12, errors
    assert max(errors) > 0  # the cache really is FP8
