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
longer, for up to GEN0_THRESHOLD allocations.

Who tunes: the engine owns its runtime, so `LLMEngine` holds the tuning from the end of its
start-up (and freezes again after its warm-up) until it is closed: the Python API, `tokenfleet
generate`, the benchmarks and the scheduler service all get it the same way. Left untuned, an
in-process burst of 2,000 requests on an H100 spent about 17% of its time in steps of 250-350 ms,
one every 30-56 steps: the full collections walking the heap. Processes that serve until they
exit (the gateway, the publisher) call `tune_for_serving` once their start-up is done.
"""

from __future__ import annotations

import atexit
import gc

GEN0_THRESHOLD = 10_000  # allocations between young collections (CPython's default: 700)

_default_threshold: tuple[int, int, int] | None = None  # set while tuned: what to restore
_num_holders = 0  # engines of this process that hold the tuning
_is_permanent = False  # a serving process tuned itself for its lifetime
_is_atexit_registered = False


def tune_for_serving() -> None:
    """For a process that serves until it exits: freeze the heap built so far and collect young
    objects less often. Call once startup (model, graphs, tokenizer) is done; calling it again
    after more startup freezes what was added."""
    global _is_permanent
    _is_permanent = True
    _freeze_and_raise_threshold()


def hold() -> None:
    """An engine of this process starts serving: the same tuning, kept until every holder has
    released it (scheduler/engine.py holds it from the end of its start-up to its close)."""
    global _num_holders
    _num_holders += 1
    _freeze_and_raise_threshold()


def refreeze() -> None:
    """More long-lived state was built while tuned (a warm-up's compiled kernels, graphs): move
    it out of the full collections' walks too. Does nothing when not tuned."""
    if _default_threshold is not None:
        gc.collect()
        gc.freeze()


def release() -> None:
    """An engine that held the tuning closed. The last one gives the frozen heap back to the
    collector (cycles among a closed engine's objects can then be freed) and restores the
    thresholds, unless the process tuned itself for its lifetime."""
    global _num_holders, _default_threshold
    _num_holders = max(0, _num_holders - 1)
    if _num_holders == 0 and not _is_permanent and _default_threshold is not None:
        gc.unfreeze()
        gc.set_threshold(*_default_threshold)
        _default_threshold = None


def is_tuned() -> bool:
    return _default_threshold is not None


def _freeze_and_raise_threshold() -> None:
    global _default_threshold, _is_atexit_registered
    gc.collect()  # startup's own garbage first: what is frozen is never collected as a cycle
    gc.freeze()
    if _default_threshold is None:
        _default_threshold = gc.get_threshold()
        _, gen1, gen2 = _default_threshold
        gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
    if not _is_atexit_registered:
        _is_atexit_registered = True
        # At exit the frozen objects go back to the collector, so that finalization frees them
        # (left frozen, Triton's nanobind reports each of its objects as leaked).
        atexit.register(gc.unfreeze)
