"""A step's batch and result survive the trip to the ranks (pickling, as Ray's channels do)."""

from __future__ import annotations

import pickle

import ray.cloudpickle
import torch

from shared.sampling import SamplingParams
from shared.step import LoraLoad, SampledToken, SequenceWork, StepBatch, StepResult, TokenBitmask


def test_a_batch_and_a_result_come_back_equal_field_for_field():
    every_field = SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=20, min_p=0.1, seed=5,
                                 stop=["end"], stop_token_ids=[3], presence_penalty=0.5,
                                 frequency_penalty=0.2,
                                 repetition_penalty=1.1, logprobs=2, ignore_eos=True,
                                 grammar='{"type": "json_object"}')
    sampling = [SamplingParams(), every_field]
    works = [SequenceWork(f"r{i}", [i, i + 1], 10 * i, [i, i + 1, i + 2], i % 2 == 0, sampling[i % 2], i,
                          [1, 2] if i % 2 else [], [3] if i % 2 else [], lora_slot=i % 3) for i in range(6)]
    for i, work in enumerate(works):
        work.num_draft_tokens = (i + 1) % 3  # (speculative decoding's drafts)
    mask = TokenBitmask(rows=[0], bits=torch.tensor([[5, -1]], dtype=torch.int32))
    loads = [LoraLoad(2, 7, "sql", "/adapters/sql")]
    batch = StepBatch(4, works, mask, freed_req_ids=["gone", "preempted"], lora_loads=loads)
    for dumps in (pickle.dumps, ray.cloudpickle.dumps):
        back = pickle.loads(dumps(batch))
        assert back.works == works and back.step_id == 4
        assert back.freed_req_ids == ["gone", "preempted"]
        assert back.lora_loads == loads
        assert back.token_mask.rows == [0] and torch.equal(back.token_mask.bits, mask.bits)
    result = StepResult(4, [SampledToken("r0", 9, num_accepted_drafts=2),
                            SampledToken("r2", 8, -0.25, [(8, -0.25), (1, -2.0)])])
    assert pickle.loads(ray.cloudpickle.dumps(result)) == result


def test_a_batch_leaves_the_process_only_with_its_mask_filled():
    mask = TokenBitmask(rows=[0], bits=torch.tensor([[3]], dtype=torch.int32))
    calls = []
    batch = StepBatch(1, [SequenceWork("r", [1], 0, [0], True, SamplingParams())],
                      mask_filler=lambda: calls.append("fill") or mask)
    try:
        pickle.dumps(batch)
        raise AssertionError("a batch whose filler holds the scheduler's matchers was pickled")
    except ValueError as exc:
        assert "resolve_token_mask" in str(exc)
    assert batch.resolve_token_mask() is mask and batch.resolve_token_mask() is mask
    assert calls == ["fill"]  # filled once, when the runner asks
    back = pickle.loads(ray.cloudpickle.dumps(batch))
    assert back.mask_filler is None and torch.equal(back.token_mask.bits, mask.bits)
