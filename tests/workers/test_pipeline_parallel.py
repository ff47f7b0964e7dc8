"""Pipeline parallelism on a real local Ray under gloo: the layers split across stages, each
stage holding only its own, with greedy output token for token as transformers'."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.model_config import load_model_config
from shared.sampling import SamplingParams
from tests.hf_reference import assert_greedy_matches, hf_greedy
from tests.workers.test_ray_group import generate_killing_a_rank
from workers.models.registry import MODEL_CLASSES
from workers.parallel import SINGLE_DEVICE
from workers.pipeline import PipelineStage, split_layers

NUM_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def _config(folder, **overrides) -> EngineConfig:
    base = dict(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=256,
                max_num_seqs=8, max_num_batched_tokens=32)
    return EngineConfig(**{**base, **overrides})


def test_layers_split_into_contiguous_runs_earlier_stages_taking_the_extra_ones():
    assert split_layers(30, 2) == [range(0, 15), range(15, 30)]
    assert split_layers(3, 2) == [range(0, 2), range(2, 3)]
    assert split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(ValueError, match="2 layers cannot be split into 3"):
        split_layers(2, 3)


def test_a_stage_builds_only_its_layers_and_its_end_of_the_model(tiny_checkpoints):
    cfg = load_model_config(tiny_checkpoints["smollm_tied"])  # 4 layers, tied embeddings
    cls = MODEL_CLASSES[cfg.model_type]
    with torch.device("meta"):
        first = cls(cfg, SINGLE_DEVICE, 64, PipelineStage(0, 2))
        last = cls(cfg, SINGLE_DEVICE, 64, PipelineStage(1, 2))
    first_names = {name for name, _ in first.named_parameters()}
    last_names = {name for name, _ in last.named_parameters()}
    assert {n.split(".")[2] for n in first_names if n.startswith("model.layers.")} == {"0", "1"}
    assert {n.split(".")[2] for n in last_names if n.startswith("model.layers.")} == {"2", "3"}
    assert "model.embed_tokens.weight" in first_names and "lm_head.weight" not in first_names
    assert "model.norm.weight" not in first_names
    assert {"model.norm.weight", "lm_head.weight"} <= last_names
    assert "model.embed_tokens.weight" not in last_names
    # Tied: the last stage's head loads from the embedding's tensor; other stages skip it.
    assert last.stage_tensor_name("model.embed_tokens.weight") == "lm_head.weight"
    assert first.stage_tensor_name("model.layers.3.mlp.down_proj.weight") is None


def _stage_bytes(folder, num_stages: int) -> list[int]:
    """Bytes of the checkpoint tensors each stage should hold (float32 checkpoint)."""
    cfg = load_model_config(folder)
    ranges = split_layers(cfg.num_layers, num_stages)
    totals = [0] * num_stages
    [path] = folder.glob("*.safetensors")
    with safe_open(str(path), framework="pt") as reader:
        for name in reader.keys():  # noqa: SIM118
            size = reader.get_tensor(name).numel() * 4
            if name.startswith("model.layers."):
                index = int(name.split(".")[2])
                totals[next(s for s, r in enumerate(ranges) if index in r)] += size
            elif name.startswith("model.embed_tokens."):
                totals[0] += size
                if cfg.tie_word_embeddings:
                    totals[-1] += size  # the last stage's own copy, as its LM head
            else:  # final norm, untied LM head
                totals[-1] += size
    for stage, layers in enumerate(ranges):  # each layer's K and V scale of an FP8 cache (float32)
        totals[stage] += 2 * 4 * len(layers)
    return totals


@pytest.mark.slow
def test_pp2_holds_half_the_layers_per_stage_and_decodes_as_transformers(tiny_checkpoints):
    folder = tiny_checkpoints["smollm_tied"]
    prompts = _prompts(6)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    refs = [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]
    with LLMEngine(_config(folder, pp=2)) as engine:
        group = engine.executor
        assert group.rank_weight_bytes() == _stage_bytes(folder, 2)
        results = engine.generate(prompts, GREEDY)
        # Both stages had work at once: a second step went in before the first came back.
        assert group.peak_in_flight == 2
    for result, ref in zip(results, refs, strict=True):
        assert_greedy_matches(result.token_ids, ref, allow_near_tie=False)


@pytest.mark.slow
def test_pp2_by_tp2_on_four_gloo_ranks_decodes_as_transformers(tiny_checkpoints):
    folder = tiny_checkpoints["qwen2"]  # 3 layers: stage 0 takes 2, stage 1 one; q/k/v biases
    prompts = _prompts(5, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    refs = [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]
    with LLMEngine(_config(folder, pp=2, tp=2, device="cpu")) as engine:  # four ranks even on a 2-GPU host
        assert [info.stage for info in engine.executor.infos] == [0, 0, 1, 1]
        results = engine.generate(prompts, GREEDY)
    for result, ref in zip(results, refs, strict=True):
        assert_greedy_matches(result.token_ids, ref, allow_near_tie=False)


@pytest.mark.slow
@pytest.mark.parametrize("victim_rank", [0, 1])
def test_a_killed_stage_rank_is_rebuilt_and_every_request_completes_identically(victim_rank,
                                                                               tiny_checkpoints):
    folder = tiny_checkpoints["llama"]
    prompts = _prompts(6, seed=2)
    with LLMEngine(_config(folder, pp=2)) as engine:
        undisturbed = [r.token_ids for r in engine.generate(prompts, GREEDY)]
        # Mid-generation, with steps of both stages in flight.
        assert generate_killing_a_rank(engine, prompts, GREEDY, victim_rank, steps_before=10) == undisturbed


def test_more_stages_than_layers_is_refused_before_any_rank_starts(tiny_checkpoints):
    from shared.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="pp=3 pipeline stages need at least as many layers"):
        LLMEngine(_config(tiny_checkpoints["qwen3"], pp=3))  # 2 layers

