"""The pipeline stage a rank belongs to: which layers it holds, and whom it hands activations to.

With `pp` stages of `tp` ranks each, the model's layers split into `pp` contiguous runs, one
per stage; within a stage the layers are tensor-parallel as usual. Global rank
`stage * tp + tp_rank`: rank t of stage s receives its input from rank t of stage s - 1 and
sends its output to rank t of stage s + 1 (every rank of a stage holds the whole activation
after its all-reduces, so each pair moves the full tensor; nothing crosses between pairs).

What crosses a stage boundary is one tensor per step, [num_tokens, hidden]: the residual
stream (the last layer's output plus its residual), from which the next stage's first layer
starts exactly as Hugging Face's decoder loop does. Stage 0 embeds the tokens; the last stage
applies the final norm and the LM head, and samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.parallel import CudaSpanTimer


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges, as even as possible; earlier stages take the extra layers
    (the last stage also runs the LM head)."""
    if num_stages < 1:
        raise ValueError(f"pipeline-parallel size must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(f"{num_layers} layers cannot be split into {num_stages} pipeline stages")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        end = start + base + (1 if stage < extra else 0)
        ranges.append(range(start, end))
        start = end
    return ranges


@dataclass(frozen=True)
class PipelineStage:
    index: int = 0
    size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    timer: CudaSpanTimer | None = None  # set only to profile (EngineConfig.time_collectives)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def layers(self, num_layers: int) -> range:
        """The global indices of the layers this stage holds."""
        return split_layers(num_layers, self.size)[self.index]

    def _peer(self, stage: int) -> int:
        return stage * self.tp_size + self.tp_rank

    def receive(self, num_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The previous stage's activation for this step: [num_tokens, hidden]."""
        buffer = torch.empty(num_tokens, hidden, dtype=dtype, device=device)
        start = self.timer.start(device) if self.timer else None
        dist.recv(buffer, src=self._peer(self.index - 1))
        if self.timer:
            self.timer.stop("p2p", start, buffer.numel() * buffer.element_size())
        return buffer

    def send(self, activation: torch.Tensor) -> None:
        """Hand this step's activation to the next stage. On CUDA, NCCL queues the send on the
        stream and the host goes on (the stream waits for the receiver); gloo returns once the
        bytes are on their way."""
        activation = activation.contiguous()
        start = self.timer.start(activation.device) if self.timer else None
        dist.send(activation, dst=self._peer(self.index + 1))
        if self.timer:
            self.timer.stop("p2p", start, activation.numel() * activation.element_size())


SINGLE_STAGE = PipelineStage()
