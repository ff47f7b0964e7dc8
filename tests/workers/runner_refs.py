"""Weak references to what a ModelRunner owns on its device, to check that close drops it all."""

from __future__ import annotations

import gc
import itertools
import weakref

from workers.model_runner import ModelRunner


def runner_weakrefs(runner: ModelRunner) -> dict[str, weakref.ref]:
    """Weak references to what a runner owns on its device: every parameter and buffer, the
    module, the KV cache, the sampler, and the CUDA-graph buffers when graphs were captured."""
    refs = {"model": weakref.ref(runner.model), "kv_caches": weakref.ref(runner.kv_caches)}
    for name, tensor in itertools.chain(runner.model.named_parameters(), runner.model.named_buffers()):
        refs[name] = weakref.ref(tensor)
    if runner.sampler is not None:
        refs["sampler"] = weakref.ref(runner.sampler)
    graphs = runner.decode_graphs
    if graphs is not None:
        refs["decode_graphs.model"] = weakref.ref(graphs.model)
        for name in ("token_ids", "positions", "slot_mapping", "context_lens", "query_start_loc",
                     "block_tables", "out"):
            refs[f"decode_graphs.{name}"] = weakref.ref(getattr(graphs, name))
    return refs


def alive(refs: dict[str, weakref.ref]) -> list[str]:
    gc.collect()
    return [name for name, ref in refs.items() if ref() is not None]
