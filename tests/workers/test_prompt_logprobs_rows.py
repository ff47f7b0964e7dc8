"""Prompt logprobs read the eager step's hidden states by work, in the eager step's own row
order (decodes first): a scored chunk behind a decode in the batch still gets its own rows."""

from __future__ import annotations

import torch

from shared.sampling import SamplingParams
from shared.step import SequenceWork
from workers import prompt_logprobs
from workers.step_inputs import eager_order

VOCAB = 8


def test_a_scored_chunk_behind_a_decode_reads_its_own_rows() -> None:
    scored = SequenceWork("scored", [1, 2, 3], 0, [0], True, SamplingParams(prompt_logprobs=0),
                          prompt_logprob_ids=[2, 3])
    decode = SequenceWork("decode", [5], 7, [1], True, SamplingParams())
    works = [scored, decode]  # batch order: the chunk first (a more important prefill)
    assert eager_order(works) == [1, 0]  # the eager step lays the decode out first
    # Hidden rows as the eager step holds them: the decode's row, then the chunk's three.
    # Each row's logits put all their mass on one token: row r says token `owner[r]`.
    owner = [7, 2, 3, 6]  # the decode row; then the chunk's rows predicting tokens 2, 3 (and 6)
    hidden = torch.full((4, VOCAB), -30.0)
    for row, token in enumerate(owner):
        hidden[row, token] = 30.0
    out = prompt_logprobs.compute(lambda h: h, hidden, works, is_driver=True).to_host()
    # Read from the right rows, both targets are (nearly) certain: logprob ~ 0. Read one row off
    # (batch order), the first target would come from the decode's row: logprob ~ -60.
    assert [entry[0] for entry in out["scored"]] == [2, 3]
    assert all(entry[1] > -1e-3 for entry in out["scored"]), out
