"""Python's cyclic garbage collector, tuned for a serving process once it has started.

Every process of the fleet starts by building a large heap that lives as long as it does: torch
and Triton's modules, the model, the tokenizer's vocabularies. By default the collector runs a
young collection every 700 allocations and, every hundred of those, a full one that walks that
whole heap again. A serving loop allocates fast (each step's works and records, each request's
parsed body), so those walks become a large share of its time, and they run on the thread that
should be launching steps or answering streams:

- the engine loop of a 500-request burst with the model taken out (`scripts/bench_host_loop.py`
  on this repository's 2-core CPU): 2.1 ms of host time per step, 1.0 with the startup heap
  frozen and young collections every 10,000 allocations;
- one gateway worker taking 500 streamed completions at once: its last XADD 0.76-0.80 s after
  the first POST, 0.60 s tuned (the same as with the collector off).

So once startup is done, `tune_for_serving` moves what is alive into the permanent generation
(`gc.freeze`: the full collections no longer walk it; vLLM freezes its heap after warm-up too)
and raises the young threshold. Objects die by reference counting as before; only cycles wait
longer, for up to GEN0_THRESHOLD allocations. The in-process engines the benchmarks compare the
fleet with are tuned the same way, so that a ratio measures the fleet, not the collector.
"""

from __future__ import annotations

import atexit
import gc

GEN0_THRESHOLD = 10_000  # allocations between young collections (CPython's default: 700)

_tuned = False


def tune_for_serving() -> None:
    """Freeze the heap built so far and collect young objects less often; call once startup
    (model, graphs, tokenizer) is done. Idempotent."""
    global _tuned
    if _tuned:
        return
    _tuned = True
    gc.collect()  # startup's own garbage first: what is frozen is never collected as a cycle
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
    # At exit the frozen objects go back to the collector, so that finalization frees them
    # (left frozen, Triton's nanobind reports each of its objects as leaked).
    atexit.register(gc.unfreeze)
