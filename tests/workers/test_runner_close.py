"""ModelRunner.close gives back everything the runner took, so that the next engine built in the
same process, whose KV cache is sized from free GPU memory, finds that memory free.

On the H200, bench_gpu.py's second engine found "no memory is left for the KV cache": the
script still held the first engine's DecodeGraphs (which hold the model and the KV cache), and
what had been freed stayed in PyTorch's caching allocator, which the driver counts as taken.
These tests pin, on CPU, what close drops; tests/workers/test_cuda_paths.py checks the memory
itself on a GPU.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from shared.config import EngineConfig
from shared.sampling import SamplingParams
from shared.step import SequenceWork, StepBatch
from tests.workers.runner_refs import alive, runner_weakrefs
from workers.cuda_graphs import use_cuda_graphs
from workers.executor import InProcessExecutor
from workers.model_runner import ModelRunner, kv_blocks_for_budget, release_device_memory
from workers.parallel import SINGLE_DEVICE

GREEDY = SamplingParams(temperature=0.0)


def _config(folder, **overrides) -> EngineConfig:
    base = dict(model=str(folder), dtype="float32", device="cpu", block_size=4, num_kv_blocks=32)
    return EngineConfig(**{**base, **overrides})


def _run_a_step(runner: ModelRunner) -> None:
    work = SequenceWork("a", [5, 6, 7], 0, [0], True, GREEDY)
    assert runner.execute(StepBatch(0, [work])) is not None


def test_close_frees_weights_kv_cache_and_sampler_while_the_runner_is_still_held(tiny_checkpoints) -> None:
    runner = ModelRunner(_config(tiny_checkpoints["llama"]), SINGLE_DEVICE)
    _run_a_step(runner)
    refs = runner_weakrefs(runner)
    assert alive(refs) == list(refs)
    runner.close()
    assert alive(refs) == []  # the runner itself is still referenced here, as a script's local would be
    assert runner.kv_cache_bytes == 0


def test_close_releases_kv_cache_and_weight_storage_held_from_outside(tiny_checkpoints) -> None:
    """A tensor or module someone kept (a test, a benchmark's local) keeps no memory after close."""
    runner = ModelRunner(_config(tiny_checkpoints["qwen2"]), SINGLE_DEVICE)
    kv_caches, model = runner.kv_caches, runner.model
    runner.close()
    assert kv_caches.untyped_storage().nbytes() == 0
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "meta" for b in model.buffers())


def test_close_is_idempotent_and_a_closed_runner_refuses_steps(tiny_checkpoints) -> None:
    runner = ModelRunner(_config(tiny_checkpoints["llama"]), SINGLE_DEVICE)
    runner.close()
    runner.close()
    assert runner.is_closed and runner.model is None and runner.kv_caches is None
    with pytest.raises(RuntimeError, match="closed"):
        _run_a_step(runner)


def test_release_device_memory_collects_cycles_before_emptying_the_cuda_cache(monkeypatch) -> None:
    """Tensors kept only by a reference cycle go back to the caching allocator first; then its
    free blocks go back to the driver (after the device has finished with them)."""
    class Holder:
        pass

    holder = Holder()
    holder.self = holder  # a cycle: refcounting alone never frees it
    holder.tensor = torch.zeros(4)
    tensor_ref = weakref.ref(holder.tensor)
    del holder
    calls = []

    def empty_cache() -> None:
        calls.append("empty_cache" if tensor_ref() is None else "empty_cache before the cycle was freed")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    release_device_memory(torch.device("cuda", 0))
    assert calls == ["synchronize", "empty_cache"]
    release_device_memory(torch.device("cpu"))
    assert calls == ["synchronize", "empty_cache"]  # CPU: no CUDA call


def test_kv_blocks_for_budget_takes_a_fraction_of_free_memory_less_activations_and_scratch() -> None:
    block = 1 << 20
    assert kv_blocks_for_budget(100 * block, fraction=0.9, activation_bytes=10 * block,
                                block_bytes=block) == 79  # 90 - 10, less the scratch block
    assert kv_blocks_for_budget(100 * block, fraction=1.0, activation_bytes=0, block_bytes=block) == 99
    # What an earlier engine still holds comes off the next one's budget, down to nothing.
    assert kv_blocks_for_budget(8 * block, fraction=0.9, activation_bytes=10 * block, block_bytes=block) == 0


def test_cuda_kv_sizing_hands_cached_blocks_back_before_reading_free_memory(tiny_checkpoints,
                                                                            monkeypatch) -> None:
    """Blocks PyTorch caches unused (a closed engine's) are free for the next KV cache, but the
    driver counts them as taken until the cache hands them back."""
    runner = ModelRunner(_config(tiny_checkpoints["llama"]), SINGLE_DEVICE)
    block = runner.kv_block_bytes
    driver = {"free": 3 * block}  # less than the activations' room: no block at all

    def empty_cache() -> None:
        driver["free"] += 1000 * block  # what the caching allocator held unused

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (driver["free"], 1 << 40))
    runner.device = torch.device("cuda", 0)  # only the sizing runs, with CUDA's answers faked
    runner.config = _config(tiny_checkpoints["llama"], num_kv_blocks=None, kv_cache_memory_fraction=1.0,
                            max_num_batched_tokens=1, cuda_graph_max_tokens=0)
    activations = 64 * runner.model_config.hidden_size * 4
    assert activations > 3 * block
    assert runner._decide_num_kv_blocks() == kv_blocks_for_budget(
        1003 * block, fraction=1.0, activation_bytes=activations, block_bytes=block)
    # With mixed-step graphs (where Triton is installed), their private pool gets as much room again.
    runner.config.cuda_graph_max_tokens = 1
    if use_cuda_graphs(runner.config, runner.device):
        assert runner._decide_num_kv_blocks() == kv_blocks_for_budget(
            2003 * block, fraction=1.0, activation_bytes=2 * activations, block_bytes=block)


def test_in_process_executor_closes_its_runner_on_shutdown_and_before_a_restart(tiny_checkpoints) -> None:
    executor = InProcessExecutor(_config(tiny_checkpoints["llama"]))
    old = executor.runner
    refs = runner_weakrefs(old)
    built_while_old_open = []
    start = executor._start

    def start_and_check() -> None:
        # On CUDA the new runner sizes its KV cache from free memory: the old one must be gone.
        built_while_old_open.append(not old.is_closed)
        start()

    executor._start = start_and_check
    executor.restart()
    assert built_while_old_open == [False] and old.is_closed and alive(refs) == []
    new = executor.runner
    executor.shutdown()
    executor.shutdown()
    assert new.is_closed and executor.runner is None

