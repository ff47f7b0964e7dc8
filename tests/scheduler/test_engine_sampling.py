"""Sampling parameters through the whole engine: seeds, stops, EOS, logprobs."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams


def _engine(folder, **overrides) -> LLMEngine:
    config = dict(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=8,
                  max_num_batched_tokens=32)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


SEEDED = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)


def test_seeded_sampling_is_reproducible_across_batches_and_preemption(tiny_checkpoints) -> None:
    folder = tiny_checkpoints["qwen3"]
    [target] = _prompts(7, [19])
    others = _prompts(8, [40, 3, 25, 60])
    unseeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    with _engine(folder) as engine:
        [alone] = engine.generate([target], SEEDED)
    with _engine(folder) as engine:
        batched = engine.generate([*others[:2], target, *others[2:]],
                                  [unseeded, unseeded, SEEDED, unseeded, unseeded])[2]
    with _engine(folder, num_kv_blocks=24, max_num_seqs=3) as engine:  # forces preemption
        ids = [engine.add_request(p, unseeded) for p in others] + [engine.add_request(target, SEEDED)]
        tokens = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.req_id].extend(out.new_token_ids)
        preempted = tokens[ids[-1]]
    assert batched.token_ids == alone.token_ids
    assert preempted == alone.token_ids
    with _engine(folder) as engine:
        [other_seed] = engine.generate([target], dataclasses.replace(SEEDED, seed=99))
    assert other_seed.token_ids != alone.token_ids


def test_stop_token_id_ends_generation_and_is_kept(tiny_checkpoints) -> None:
    folder = tiny_checkpoints["llama"]
    [prompt] = _prompts(9, [12])
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with _engine(folder) as engine:
        [free] = engine.generate([prompt], greedy)
        stop_id = free.token_ids[5]
        first = free.token_ids.index(stop_id)
        with_stop = dataclasses.replace(greedy, stop_token_ids=[stop_id])
        [stopped] = engine.generate([prompt], with_stop)
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason.value == "stop"
    assert stopped.stop_reason == stop_id


def test_eos_stops_unless_ignore_eos(tiny_checkpoints, tmp_path) -> None:
    """EOS comes from the checkpoint's generation_config.json: point it at a token the model
    greedily produces, and generation must end there."""
    [prompt] = _prompts(10, [8])
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with _engine(tiny_checkpoints["llama"]) as engine:
        [free] = engine.generate([prompt], greedy)
    eos = free.token_ids[4]
    folder = tmp_path / "eos"
    shutil.copytree(tiny_checkpoints["llama"], folder)
    gen_config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen_config, "eos_token_id": [eos]}))
    with _engine(folder) as engine:
        [with_eos] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))
        [ignored] = engine.generate([prompt], greedy)
    assert with_eos.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    assert with_eos.finish_reason.value == "stop" and with_eos.stop_reason is None
    assert ignored.token_ids == free.token_ids and ignored.finish_reason.value == "length"


def test_logprobs_match_transformers_log_softmax(tiny_checkpoints) -> None:
    folder = tiny_checkpoints["qwen2"]
    [prompt] = _prompts(11, [15])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with _engine(folder) as engine:
        [result] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6,
                                                            ignore_eos=True, logprobs=3))
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + result.token_ids])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # [6, vocab]
    assert len(result.logprobs) == 6
    for step, entry in enumerate(result.logprobs):
        assert entry.token_id == result.token_ids[step]
        assert entry.logprob == pytest.approx(float(expected[step, entry.token_id]), abs=1e-4)
        top_ids = [t for t, _ in entry.top_logprobs]
        assert top_ids == expected[step].topk(3).indices.tolist()


@pytest.mark.slow
def test_stop_string_is_cut_and_not_returned(smollm2) -> None:
    question = "Name three colours of the rainbow."
    greedy = SamplingParams(temperature=0.0, max_tokens=48)
    with _engine(smollm2, block_size=16, num_kv_blocks=64) as engine:
        [free] = engine.generate([question], greedy, chat=True)
        stop = free.text[10:14]  # four characters from the middle of the answer
        cut = free.text.index(stop)
        [stopped] = engine.generate([question], dataclasses.replace(greedy, stop=[stop]),
                                    chat=True)
    assert stopped.text == free.text[:cut]
    assert stopped.finish_reason.value == "stop" and stopped.stop_reason == stop
