"""The tensor-parallel group a rank belongs to, passed explicitly to every layer.

A layer never reaches for a global: it is handed a `TensorParallel` and calls its
collectives, so the same model code runs at TP=1 (no-ops) and TP=N (torch.distributed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


class CudaSpanTimer:
    """A profiling hook (EngineConfig.time_collectives): CUDA events around every step, every
    collective and every pipeline-stage send or receive of one rank, with the bytes each moved,
    summed by `read()` with one synchronize.

    Records nothing during a CUDA-graph capture; the runner runs every step eagerly while a
    timer is set, so that every collective is seen. A collective's time includes waiting for
    the slowest rank to reach it, which is part of what tensor parallelism costs.
    """

    KINDS = ("step", "collective", "p2p")

    def __init__(self) -> None:
        self._spans: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {k: [] for k in self.KINDS}
        self._bytes: dict[str, int] = dict.fromkeys(self.KINDS, 0)

    def start(self, device: torch.device) -> torch.cuda.Event | None:
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, kind: str, start: torch.cuda.Event | None, num_bytes: int = 0) -> None:
        self._bytes[kind] += num_bytes  # counted on CPU too (no events there)
        if start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._spans[kind].append((start, end))

    def read(self) -> CollectiveTimes:
        """Totals since the last read (then forgotten)."""
        if any(self._spans.values()):
            torch.cuda.synchronize()
        totals = {kind: sum(s.elapsed_time(e) for s, e in spans) for kind, spans in self._spans.items()}
        times = CollectiveTimes(len(self._spans["step"]), totals["step"], len(self._spans["collective"]),
                                totals["collective"], self._bytes["collective"], len(self._spans["p2p"]),
                                totals["p2p"], self._bytes["p2p"])
        self._spans = {k: [] for k in self.KINDS}
        self._bytes = dict.fromkeys(self.KINDS, 0)
        return times


@dataclass
class CollectiveTimes:
    """GPU milliseconds of the steps and of the collectives and stage hand-offs inside them, and
    the bytes those moved (this rank's tensors), since the last reading."""

    num_steps: int = 0
    step_ms: float = 0.0
    num_collectives: int = 0
    collective_ms: float = 0.0
    collective_bytes: int = 0
    num_p2p: int = 0  # pipeline-stage sends and receives
    p2p_ms: float = 0.0
    p2p_bytes: int = 0


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    timer: CudaSpanTimer | None = None  # set only to profile (EngineConfig.time_collectives)
    # The stage's own process group under pipeline parallelism; None: the default (world) group.
    group: object | None = None

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and answers the scheduler; the others only compute."""
        return self.rank == 0

    def partition(self, total: int, unit: int = 1) -> list[int]:
        """Sizes of every rank's share of `total`, in whole `unit`s, as even as possible.

        Uneven splits are allowed (the first ranks take one unit more), so a model whose
        heads do not divide by the TP size still shards: SmolLM2-135M's 3 KV heads go
        2 + 1 over two ranks.
        """
        if total % unit:
            raise ValueError(f"{total} is not a multiple of {unit}")
        units = total // unit
        if units < self.size:
            raise ValueError(f"{units} units cannot be shared by {self.size} tensor-parallel ranks")
        base, extra = divmod(units, self.size)
        return [(base + (1 if r < extra else 0)) * unit for r in range(self.size)]

    def shard(self, total: int, unit: int = 1) -> tuple[int, int]:
        """(start, size) of this rank's share of a dimension of length `total`."""
        sizes = self.partition(total, unit)
        return sum(sizes[: self.rank]), sizes[self.rank]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; where a row-parallel layer ends."""
        if self.size > 1:
            start = self.timer.start(x.device) if self.timer else None
            dist.all_reduce(x, group=self.group)
            if self.timer:
                self.timer.stop("collective", start, x.numel() * x.element_size())
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension (vocab-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        start = self.timer.start(x.device) if self.timer else None
        dist.all_gather(parts, x.contiguous(), group=self.group)
        if self.timer:
            self.timer.stop("collective", start, x.numel() * x.element_size())
        return torch.cat(parts, dim=-1)


SINGLE_DEVICE = TensorParallel()


def all_reduce_min(world_size: int, value: int) -> int:
    """The smallest of every rank's `value` over the whole group, every pipeline stage's
    ranks included (they must agree on sizes such as KV blocks: one block table serves all)."""
    if world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
