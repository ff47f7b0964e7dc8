"""The grammar mask costs the step little: it is filled on the host after the step's forward
is launched (and before the sampler runs), over several threads for large batches, and put on
the logits' rows without touching the free ones."""

from __future__ import annotations

import json

import pytest
import torch

from scheduler.engine import LLMEngine
from scheduler.grammar import Grammars, fill_threads
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from shared.step import SequenceWork, TokenBitmask
from tests.scheduler.spies import spy
from tests.scheduler.test_grammar import PET_GRAMMAR, PROMPTS, Pet
from tests.workers.triton_interpreter import run_interpreted
from workers.grammar_mask import apply_token_mask

ANY_JSON = json.dumps({"type": "json_object"})


def test_the_mask_is_filled_after_the_forward_is_launched_and_before_sampling(tiny_chat):
    config = EngineConfig(model=str(tiny_chat), dtype="float32", num_kv_blocks=64, max_num_seqs=8)
    with LLMEngine(config) as engine:
        runner, grammars = engine.executor.runner, engine.scheduler.grammars
        events: list[str] = []

        runner._forward = spy(events, "forward", runner._forward)  # (what launch calls)
        runner.sampler.sample_on_device = spy(events, "sample", runner.sampler.sample_on_device)
        grammars._fill = spy(events, "fill", grammars._fill)
        # The constrained request outlives the free one: every step has a row to mask.
        sampling = [SamplingParams(max_tokens=40, temperature=0.0, grammar=PET_GRAMMAR),
                    SamplingParams(max_tokens=4, temperature=0.0)]
        constrained, _ = engine.generate(PROMPTS[:2], sampling, chat=True)
    steps = "".join({"forward": "F", "fill": "f", "sample": "s"}[e] for e in events)
    assert steps == "Ffs" * len(constrained.token_ids)  # every step: forward, then fill, then sample
    assert constrained.finish_reason.value == "stop"
    Pet.model_validate_json(constrained.text)


def _matchers_in_several_states(smollm2, num: int) -> tuple[Grammars, list[SequenceWork]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    texts = ['{"a": "', '{"kind": 1', '{"x": [tr', '{"b": {"c": nu', '{', '{"k": "v", "w": -0.5']
    grammars = Grammars(tokenizer, 49152, [2])
    works = []
    for i in range(num):
        grammars.add(f"r{i}", ANY_JSON, tokenizer(texts[i % len(texts)], add_special_tokens=False).input_ids)
        works.append(SequenceWork(f"r{i}", [1], 9, [0], True, SamplingParams()))
    return grammars, works


def test_a_fill_over_several_threads_writes_the_bits_one_thread_writes(smollm2):
    grammars, works = _matchers_in_several_states(smollm2, 200)
    grammars.num_fill_threads = 1
    serial = grammars.fill(works)
    grammars.num_fill_threads = 4
    parallel = grammars.fill(works)
    assert parallel.rows == serial.rows == list(range(200))
    assert torch.equal(parallel.bits, serial.bits)
    assert len({tuple(row.tolist()) for row in serial.bits}) > 1  # the matchers differ: a real test


def test_fill_threads_grow_with_the_rows_and_stay_within_half_the_cores():
    assert fill_threads(64, cores=16) == 1  # a small batch: one thread (waking others costs more)
    assert fill_threads(256, cores=16) == 1  # (measured on the H200's host: threads hardly pay)
    assert fill_threads(512, cores=16) == 2
    assert fill_threads(4096, cores=16) == 2  # MAX_FILL_THREADS
    assert fill_threads(512, cores=2) == 1  # this CPU: the other core is the scheduler's
    assert fill_threads(1, cores=1) == 1


def test_the_mask_of_some_rows_leaves_the_other_rows_untouched():
    logits = torch.randn(4, 64)
    before = logits.clone()
    bits = torch.tensor([[0b1011, 0], [-1, 1]], dtype=torch.int32)  # rows 1 and 3 of the batch
    apply_token_mask(logits, TokenBitmask(rows=[1, 3], bits=bits))
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    allowed_1 = [t for t in range(64) if torch.isfinite(logits[1, t])]
    allowed_3 = [t for t in range(64) if torch.isfinite(logits[3, t])]
    assert allowed_1 == [0, 1, 3] and allowed_3 == list(range(32)) + [32]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path: pinned uploads, Triton kernel")
def test_on_cuda_the_mask_matches_the_cpu_mask_step_after_step():
    generator = torch.Generator().manual_seed(0)
    for num_rows, rows in [(8, list(range(8))), (8, [1, 5]), (300, list(range(0, 300, 4))), (8, [7])]:
        bits = torch.randint(-2**31, 2**31 - 1, (len(rows), 49152 // 32), dtype=torch.int32,
                             generator=generator)
        logits = torch.randn(num_rows, 49152, generator=generator)
        expected = logits.clone()
        apply_token_mask(expected, TokenBitmask(rows, bits))
        on_gpu = logits.cuda().to(torch.bfloat16)
        apply_token_mask(on_gpu, TokenBitmask(rows, bits))
        assert torch.equal(torch.isinf(on_gpu.cpu()), torch.isinf(expected))


_INTERPRETED_ROWS_CHECK = """
import types
import torch
torch.cuda.get_device_properties = lambda *_: types.SimpleNamespace(multi_processor_count=4, gcnArchName="")
from shared.step import TokenBitmask
from workers.grammar_mask import apply_token_mask, mask_rows
generator = torch.Generator().manual_seed(0)
for num_rows, rows in [(6, [1, 4]), (5, [0, 1, 2, 3, 4]), (9, [8])]:
    bits = torch.randint(-2**31, 2**31 - 1, (len(rows), 8192 // 32), dtype=torch.int32, generator=generator)
    logits = torch.randn(num_rows, 8192, generator=generator)
    expected = logits.clone()
    apply_token_mask(expected, TokenBitmask(rows, bits))
    mask_rows(logits, bits, torch.tensor(rows, dtype=torch.int32), backend="triton")
    assert torch.equal(torch.isinf(logits), torch.isinf(expected)), rows
print("ok")
"""


def test_the_cuda_paths_row_layout_masks_the_right_rows_in_the_triton_interpreter():
    """The GPU path's layout (the constrained rows' bits placed at their rows, the kernel told
    which rows) through xgrammar's Triton kernel, run by Triton's CPU interpreter."""
    run_interpreted(_INTERPRETED_ROWS_CHECK)


def test_under_async_scheduling_a_constrained_request_is_in_every_step(tiny_chat):
    """A constrained request is planned ahead like any other (its step ahead samples late, once
    its last token is accepted: tests/scheduler/test_grammar_async.py): it gets a token every
    step, not every other step."""
    config = EngineConfig(model=str(tiny_chat), dtype="float32", num_kv_blocks=64, max_num_seqs=8,
                          async_scheduling=True)
    with LLMEngine(config) as engine:
        sampling = [SamplingParams(max_tokens=24, temperature=0.0, grammar=PET_GRAMMAR),
                    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)]
        constrained, free = engine.generate(PROMPTS[:2], sampling, chat=True)
        num_steps = engine.num_steps
    Pet.model_validate_json(constrained.text)
    assert len(free.token_ids) == 24
    # One step per token of the longer one (the prefill's step makes the first; the free one's
    # waits a step for the prompt prefix the first computes; the step ahead of the grammar's end
    # is dropped): not 2 per token.
    assert num_steps <= max(len(constrained.token_ids), len(free.token_ids)) + 2, num_steps
