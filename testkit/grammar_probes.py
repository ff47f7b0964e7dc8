"""Timers on an in-process engine's grammar work: the seconds a decode step spends choosing the
constrained rows, filling the token bitmask (and how often that fill was hidden behind the
forward on CUDA), applying the mask to the logits and advancing the matchers. Installed on the
engine's own objects for a block, removed after it (scripts/bench_structured.py's pass (c))."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import workers.model_runner as model_runner_module
from testkit.roofline import sync

if TYPE_CHECKING:
    from scheduler.engine import LLMEngine


@dataclass
class Probes:
    """Seconds spent in each grammar part over the timed steps, and how often the fill was hidden."""

    pick: float = 0.0  # schedule(): choosing the constrained rows (Grammars.mask_filler)
    fill: float = 0.0
    apply: float = 0.0
    accept: float = 0.0
    num_fills: int = 0
    num_hidden: int = 0  # fills that ended while the device still ran the forward


@contextlib.contextmanager
def probed(engine: LLMEngine, device: torch.device, probes: Probes, timing: list[bool]):
    """Time the grammar's parts (counted while timing[0] is true). The apply is synchronised on
    CUDA, so that its copies and kernel are what is timed; the fill is not (it overlaps)."""
    grammars, runner = engine.scheduler.grammars, engine.executor.runner
    forward_done: list[torch.cuda.Event | None] = [None]

    def timed(fn, name: str, synchronise: bool = False, after=None):
        def wrapper(*args, **kwargs):
            if synchronise:
                sync(device)
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            if synchronise:
                sync(device)
            if timing[0]:
                setattr(probes, name, getattr(probes, name) + time.perf_counter() - start)
                if after is not None:
                    after()
            return result
        return wrapper

    def forward(*args, **kwargs):
        result = runner_forward(*args, **kwargs)
        if device.type == "cuda":
            forward_done[0] = torch.cuda.Event()
            forward_done[0].record()
        return result

    def count_hidden() -> None:
        probes.num_fills += 1
        probes.num_hidden += forward_done[0] is not None and not forward_done[0].query()

    runner_forward = runner.forward
    runner.forward = forward
    grammars._fill = timed(grammars._fill, "fill", after=count_hidden)
    grammars.mask_filler = timed(grammars.mask_filler, "pick")
    grammars.accept = timed(grammars.accept, "accept")
    apply = model_runner_module.apply_token_mask
    model_runner_module.apply_token_mask = timed(apply, "apply", synchronise=True)
    try:
        yield
    finally:
        del runner.forward, grammars._fill, grammars.mask_filler, grammars.accept
        model_runner_module.apply_token_mask = apply
