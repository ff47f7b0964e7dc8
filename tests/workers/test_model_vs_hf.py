"""Our model code against the transformers implementation of the same checkpoint: logits."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.config import EngineConfig
from shared.sampling import SamplingParams
from shared.step import SequenceWork, StepBatch
from testkit.checkpoints import TINY_ARCHS, make_tiny_checkpoint
from workers.model_runner import ModelRunner
from workers.parallel import SINGLE_DEVICE

GREEDY = SamplingParams(temperature=0.0)


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.cpu() - ref).abs().max() / ref.abs().max())


def _runner(folder, **config) -> ModelRunner:
    """float32 on whatever device is present (CUDA runs it too, against transformers on CPU)."""
    return ModelRunner(EngineConfig(model=str(folder), dtype="float32", **config), SINGLE_DEVICE)


def _prefill_then_decode_logits(runner: ModelRunner, prompt: list[int], split: int) -> torch.Tensor:
    """Logits at the last prompt position after a prefill of `split` tokens, then one token at
    a time (exercising chunked prefill and the decode path)."""
    blocks = list(range(-(-len(prompt) // runner.block_size)))
    first = SequenceWork("r", prompt[:split], 0, blocks, True, GREEDY)
    rows = [runner.forward(StepBatch(0, [first]), use_graphs=False)[0].float()]
    for pos in range(split, len(prompt)):
        work = SequenceWork("r", [prompt[pos]], pos, blocks, True, GREEDY)
        rows.append(runner.forward(StepBatch(pos, [work]), use_graphs=False)[0].float())
    return torch.cat(rows)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_logits_match_transformers_within_1e4_relative(arch: str, tiny_checkpoints) -> None:
    folder = tiny_checkpoints[arch]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = _runner(folder, num_kv_blocks=64, block_size=4)
    prompt = [random.Random(arch).randrange(3, 512) for _ in range(37)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()  # [37, vocab]
    ours = _prefill_then_decode_logits(runner, prompt, split=20)  # rows for positions 19..36
    assert _relative_error(ours, ref[19:]) < 1e-4


def test_logits_match_with_legacy_rope_keys(tmp_path) -> None:
    """Hub checkpoints written by transformers 4.x keep rope_theta/rope_scaling at the top level."""
    folder = make_tiny_checkpoint("llama3_rope_scaling", tmp_path / "m", legacy_rope_keys=True)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = _runner(folder, num_kv_blocks=64, block_size=8)
    prompt = list(range(3, 200, 3))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1:].float()
    blocks = list(range(-(-len(prompt) // 8)))
    batch = StepBatch(0, [SequenceWork("r", prompt, 0, blocks, True, GREEDY)])
    ours = runner.forward(batch, use_graphs=False)[0].float()
    assert _relative_error(ours, ref) < 1e-4


@pytest.mark.slow
def test_smollm2_logits_match_transformers_within_1e4_relative(smollm2) -> None:
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    runner = _runner(smollm2, num_kv_blocks=64)
    prompt = [random.Random(1).randrange(3, 49152) for _ in range(50)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    ours = _prefill_then_decode_logits(runner, prompt, split=40)
    assert _relative_error(ours, ref[39:]) < 1e-4
