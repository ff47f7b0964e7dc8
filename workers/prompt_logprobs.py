"""Prompt logprobs: the log-probability of each prompt token given the tokens before it, taken
from the prefill's own hidden states (no forward of its own).

A prefill chunk computes positions [start_pos, start_pos + len): the hidden state at position p
predicts token p + 1. The scheduler names, per chunk, the prompt tokens its first rows predict
(`SequenceWork.prompt_logprob_ids`): the rows up to the prompt's last token, whose own logits
predict the first output token and are sampled as ever. A prompt split into chunks is thus
scored chunk by chunk, each chunk's rows in its own step.

As vLLM reports them: the log-softmax of the model's raw logits (float32), no penalty nor
temperature. Every rank of the last stage computes the logits (the LM head may gather the
vocabulary across tensor-parallel ranks); only the driver turns them into logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.step import SequenceWork
from workers.step_inputs import eager_order

# Rows turned into logits at once: [rows, vocab] float32 is 200 MB at 1024 rows of a 49k vocab.
_ROWS_PER_SLICE = 1024


def wanted(works: list[SequenceWork]) -> bool:
    return any(w.prompt_logprob_ids for w in works)


@dataclass
class DevicePromptLogprobs:
    """A step's prompt logprobs, still on the device (the driver's)."""

    req_ids: list[str]  # per scored work, in batch order
    counts: list[int]  # rows of each, in order
    top_n: list[int]  # top logprobs each asked for
    target_ids: torch.Tensor  # [num_rows] long
    chosen: torch.Tensor  # [num_rows] float32: the logprob of each target
    top_values: torch.Tensor | None  # [num_rows, k] float32, best first; None when no work wants a top
    top_ids: torch.Tensor | None  # [num_rows, k] long

    def to_host(self) -> dict[str, list]:
        """req_id -> [[token_id, logprob, [[id, logprob], ...] | None], ...] (waits for the device)."""
        target_ids = self.target_ids.tolist()
        chosen = self.chosen.tolist()
        top_values = self.top_values.tolist() if self.top_values is not None else None
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        out: dict[str, list] = {}
        row = 0
        for req_id, count, top_n in zip(self.req_ids, self.counts, self.top_n, strict=True):
            entries = []
            for r in range(row, row + count):
                top = None
                if top_n and top_ids is not None:
                    top = [list(pair) for pair in zip(top_ids[r][:top_n], top_values[r][:top_n], strict=True)]
                entries.append([target_ids[r], chosen[r], top])
            out[req_id] = entries
            row += count
        return out


def compute(compute_logits, hidden: torch.Tensor, works: list[SequenceWork],
            is_driver: bool) -> DevicePromptLogprobs | None:
    """The prompt logprobs of the step's scored works, from the eager step's hidden states
    ([num_tokens, hidden], the works' tokens concatenated in the eager step's order: decodes
    first, `eager_order`). Every rank of the last stage calls this (compute_logits may be
    collective); the driver gets the result, others None."""
    rows: list[int] = []
    targets: list[int] = []
    req_ids, counts, top_n = [], [], []
    offset = 0
    for work in (works[i] for i in eager_order(works)):
        ids = work.prompt_logprob_ids
        if ids:
            rows += range(offset, offset + len(ids))
            targets += ids
            req_ids.append(work.req_id)
            counts.append(len(ids))
            top_n.append(work.sampling.prompt_logprobs or 0)
        offset += len(work.token_ids)
    device = hidden.device
    row_index = torch.tensor(rows, dtype=torch.long, device=device)
    target_ids = torch.tensor(targets, dtype=torch.long, device=device)
    k = max(top_n)
    chosen_parts, value_parts, id_parts = [], [], []
    for start in range(0, len(rows), _ROWS_PER_SLICE):
        logits = compute_logits(hidden[row_index[start:start + _ROWS_PER_SLICE]])  # [rows, vocab]
        if not is_driver:
            continue
        logprobs = logits.float().log_softmax(dim=-1)
        chosen_parts.append(logprobs.gather(1, target_ids[start:start + _ROWS_PER_SLICE, None]).squeeze(1))
        if k:
            values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
            value_parts.append(values)
            id_parts.append(ids)
    if not is_driver:
        return None
    return DevicePromptLogprobs(req_ids, counts, top_n, target_ids, torch.cat(chosen_parts),
                                torch.cat(value_parts) if k else None, torch.cat(id_parts) if k else None)
