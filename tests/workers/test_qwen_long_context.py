"""Qwen (v1) past its training context (seq_length 64 in the tiny folder): logn attention and
dynamic NTK against a float64 reference written from the formulas (qwen_reference.py), each
flag off changing the logits there and nothing inside, the NTK alpha kept per sequence in a
mixed batch, and prefix caching never sharing K/V between sequences of different alphas."""

from __future__ import annotations

import json
import math
import pickle
import random
import shutil

import pytest
import torch

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.long_context import logn_scale, ntk_alpha, rope_offset
from shared.sampling import SamplingParams
from shared.step import SequenceWork, StepBatch
from testkit.qwen_checkpoints import TINY_QWEN
from tests.workers.qwen_reference import QwenReference
from workers.model_runner import ModelRunner
from workers.parallel import SINGLE_DEVICE

SEQ_LENGTH = TINY_QWEN["seq_length"]
GREEDY = SamplingParams(temperature=0.0)


def _ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, TINY_QWEN["vocab_size"]) for _ in range(n)]


def _with_flags(tiny_qwen, tmp_path, **flags):
    folder = tmp_path / "_".join(f"{k}-{v}" for k, v in flags.items())
    shutil.copytree(tiny_qwen, folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(flags)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def _logits(folder, prompt: list[int], split: int) -> torch.Tensor:
    """Our logits at every prompt position from `split - 1` on: a prefill of `split` tokens, then
    one token at a time, all with the NTK table of the whole prompt (as the engine runs it)."""
    runner = ModelRunner(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=128, block_size=4),
                         SINGLE_DEVICE)
    cfg = runner.model_config
    offset = rope_offset(len(prompt), seq_length=cfg.seq_length, use_dynamic_ntk=cfg.use_dynamic_ntk,
                         stride=runner.max_model_len)
    blocks = list(range(-(-len(prompt) // 4)))
    rows = [runner.forward(StepBatch(0, [SequenceWork("r", prompt[:split], 0, blocks, True, GREEDY,
                                                      rope_offset=offset)]), use_graphs=False)[0]]
    for pos in range(split, len(prompt)):
        work = SequenceWork("r", [prompt[pos]], pos, blocks, True, GREEDY, rope_offset=offset)
        rows.append(runner.forward(StepBatch(pos, [work]), use_graphs=False)[0])
    runner.close()
    return torch.cat([r.float() for r in rows]).double()


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def test_ntk_alpha_and_logn_scale_follow_the_formulas() -> None:
    assert [ntk_alpha(n, 2048) for n in (1, 2048, 2049, 4096, 4097, 8192, 8193)] == [1, 1, 3, 3, 7, 7, 15]
    assert logn_scale(2047, 2048) == 1.0  # the 2048th token: inside
    assert logn_scale(2048, 2048) == pytest.approx(math.log(2049) / math.log(2048))
    assert rope_offset(5000, seq_length=2048, use_dynamic_ntk=True, stride=8192) == 2 * 8192
    assert rope_offset(5000, seq_length=2048, use_dynamic_ntk=False, stride=8192) == 0


@pytest.mark.parametrize("length", [150, 90])  # alpha 7 and 3
def test_logits_match_the_float64_reference_past_seq_length(length, tiny_qwen) -> None:
    prompt = _ids(length, seed=length)
    ref = QwenReference(tiny_qwen).logits(prompt)
    ours = _logits(tiny_qwen, prompt, split=SEQ_LENGTH - 10)  # prefill inside, decode across the edge
    assert _relative_error(ours, ref[SEQ_LENGTH - 11:]) < 1e-4


def test_each_flag_off_changes_logits_past_seq_length_and_nothing_inside(tiny_qwen, tmp_path) -> None:
    inside, past = _ids(SEQ_LENGTH, seed=1), _ids(130, seed=2)
    both_on_inside = _logits(tiny_qwen, inside, split=40)
    both_on_past = _logits(tiny_qwen, past, split=100)
    for flag in ("use_logn_attn", "use_dynamic_ntk"):
        folder = _with_flags(tiny_qwen, tmp_path, **{flag: False})
        assert torch.equal(_logits(folder, inside, split=40), both_on_inside), flag
        off_past = _logits(folder, past, split=100)
        assert (off_past - both_on_past).abs().max() > 1e-2, flag
        ref = QwenReference(folder).logits(past)[99:]  # the reference with that flag off too
        assert _relative_error(off_past, ref) < 1e-4, flag


def test_a_mixed_batch_keeps_each_sequences_alpha_while_decoding(tiny_qwen) -> None:
    """Prompts of alpha 7, 1 and 3 in one batch (chunked prefill, then decodes crossing further
    lengths): each continues as the reference with its prompt's alpha."""
    prompts = [_ids(150, 3), _ids(20, 4), _ids(100, 5), _ids(60, 6)]
    reference = QwenReference(tiny_qwen)
    refs = [reference.greedy(p, 10) for p in prompts]
    config = EngineConfig(model=str(tiny_qwen), dtype="float32", block_size=4, num_kv_blocks=512,
                          max_num_seqs=4, max_num_batched_tokens=32)
    with LLMEngine(config) as engine:
        results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert [r.token_ids for r in results] == refs


def test_prefix_cache_shares_no_blocks_between_alphas(tiny_qwen) -> None:
    """A short prompt (alpha 1) cached first; a long one starting with it (alpha 7) must not
    reuse its K/V (rotated with another base), and does reuse its own on a repeat."""
    long_prompt = _ids(150, 7)
    short_prompt = long_prompt[:60]
    reference = QwenReference(tiny_qwen)
    expected = reference.greedy(long_prompt, 6)
    config = EngineConfig(model=str(tiny_qwen), dtype="float32", block_size=4, num_kv_blocks=512,
                          max_num_seqs=2, max_num_batched_tokens=64)
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLMEngine(config) as engine:
        engine.generate([short_prompt], sampling)
        [first] = engine.generate([long_prompt], sampling)
        [again] = engine.generate([long_prompt], sampling)
    assert first.usage.cached_tokens == 0
    assert first.token_ids == expected
    assert again.usage.cached_tokens >= 140 and again.token_ids == expected


def test_rope_offset_crosses_to_the_ranks() -> None:
    work = SequenceWork("r", [1, 2], 0, [0], True, GREEDY, rope_offset=1024)
    [back] = pickle.loads(pickle.dumps(StepBatch(3, [work]))).works
    assert back.rope_offset == 1024


def test_a_preempted_sequence_recomputes_with_its_prompts_alpha(tiny_qwen) -> None:
    """Recomputed after preemption, a sequence prefills its prompt and its output together (a
    longer "prompt" whose own alpha may be larger); it must keep the alpha of its real prompt."""
    prompts = [_ids(120, 8), _ids(124, 9), _ids(116, 10)]  # alpha 3 each; 129 tokens and more: alpha 7
    reference = QwenReference(tiny_qwen)
    refs = [reference.greedy(p, 12) for p in prompts]
    # 90 blocks of 4 = 360 slots; the three need up to 3 * 136 = 408.
    config = EngineConfig(model=str(tiny_qwen), dtype="float32", block_size=4, num_kv_blocks=90,
                          max_num_seqs=3, max_num_batched_tokens=64)
    with LLMEngine(config) as engine:
        ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
               for p in prompts]
        requests = [engine.scheduler.get_request(i) for i in ids]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.req_id].extend(out.new_token_ids)
    assert sum(r.num_preemptions for r in requests) > 0, "the small cache never forced a preemption"
    assert [tokens[i] for i in ids] == refs


def test_the_model_reads_positions_offset_and_the_kv_slots_plain() -> None:
    from workers.step_inputs import build_step_inputs

    works = [SequenceWork("a", [5], 9, [0, 1, 2], True, GREEDY, rope_offset=512),
             SequenceWork("b", [1, 2, 3], 0, [3], True, GREEDY)]
    inputs = build_step_inputs(StepBatch(0, works), 4, torch.device("cpu"))
    assert inputs.positions.tolist() == [512 + 9, 0, 1, 2]
    plain = build_step_inputs(StepBatch(0, [SequenceWork("a", [5], 9, [0, 1, 2], True, GREEDY),
                                            works[1]]), 4, torch.device("cpu"))
    assert torch.equal(inputs.meta.slot_mapping, plain.meta.slot_mapping)
