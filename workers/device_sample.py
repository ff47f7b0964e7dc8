"""A step's sampled tokens while they are still on the device, and their trip to the host.

The sampler leaves its picks on the device (`DeviceSample`): the next step's inputs take the
ids from there (workers/pending_tokens.py), and `to_host` starts one non-blocking copy into
pinned memory and records an event, so that the host waits for this step's kernels only when
it reads the ids (`HostSample.tokens`), after it has launched the next step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.step import SampledToken, SequenceWork


@dataclass
class DeviceSample:
    works: list[SequenceWork]  # row i's work
    token_ids: torch.Tensor  # [num_rows] long, on the device
    # When some row asked for logprobs: the chosen token's [num_rows], and the top
    # num_top [num_rows, num_top] (values, ids; best first; None when num_top is 0).
    logprobs: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None

    def to_host(self) -> HostSample:
        """Start the copy of everything the host needs; nothing waits here."""
        tensors = [t for t in (self.token_ids, self.logprobs, self.top_values, self.top_ids) if t is not None]
        device = self.token_ids.device
        if device.type != "cuda":
            return HostSample(self, tensors, None)
        copies = []
        for tensor in tensors:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            copies.append(host)
        event = torch.cuda.Event()
        event.record()
        return HostSample(self, copies, event)


@dataclass
class HostSample:
    sample: DeviceSample
    tensors: list[torch.Tensor]  # host copies of the sample's tensors, in DeviceSample's order
    event: torch.cuda.Event | None  # recorded after the copies (CUDA); None: already there

    def tokens(self) -> list[SampledToken]:
        """Wait for the copies (this step's kernels, not any launched after), then one
        SampledToken per row."""
        if self.event is not None:
            self.event.synchronize()
        works = self.sample.works
        values = iter(self.tensors)
        ids = next(values).tolist()
        if self.sample.logprobs is None:
            return [SampledToken(req_id=w.req_id, token_id=t) for w, t in zip(works, ids, strict=True)]
        chosen = next(values).tolist()
        top_values: list[list[float]] = [[] for _ in works]
        top_ids: list[list[int]] = [[] for _ in works]
        if self.sample.top_values is not None:
            top_values, top_ids = next(values).tolist(), next(values).tolist()
        sampled = []
        rows = zip(works, ids, chosen, top_ids, top_values, strict=True)
        for work, token_id, logprob, row_top_ids, row_top_values in rows:
            token = SampledToken(req_id=work.req_id, token_id=token_id)
            n = work.sampling.logprobs
            if n is not None:
                token.logprob = logprob
                if n > 0:
                    token.top_logprobs = list(zip(row_top_ids[:n], row_top_values[:n], strict=True))
            sampled.append(token)
        return sampled
