"""The dense LoRA path (every row against every slot, masked to its own: fixed shapes, what a
CUDA decode graph replays) against the segment-wise one, on this CPU: a decode graph's static
buffers, run eagerly, give the eager step's logits with three adapters and the base mixed."""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from shared.step import LoraLoad, SequenceWork, StepBatch
from testkit.lora_adapters import load_hf_with_adapter
from tests.hf_reference import assert_greedy_matches, hf_greedy
from tests.workers.test_mixed_graphs import fake_mixed_graphs  # noqa: F401 - a fixture
from workers.cuda_graphs import DecodeGraphs
from workers.model_runner import ModelRunner
from workers.parallel import SINGLE_DEVICE

GREEDY = SamplingParams(temperature=0.0)


def test_decode_graph_rows_with_adapters_match_the_eager_segments(tiny_checkpoints, lora_adapters) -> None:
    num_seqs = 6  # padded to 8 rows
    runner = ModelRunner(EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", block_size=4,
                                      num_kv_blocks=64, max_num_seqs=8, enable_lora=True, max_loras=3),
                         SINGLE_DEVICE)
    assert not runner.lora.is_dense  # CPU: segment-wise unless asked
    graphs = DecodeGraphs(runner.model, runner.kv_caches, block_size=4, max_model_len=runner.max_model_len,
                          scratch_block=runner.num_kv_blocks, max_batch_size=8, device=runner.device)
    loads = [LoraLoad(slot, slot, name, str(path))
             for slot, (name, path) in enumerate(lora_adapters.items(), start=1)]
    rng = random.Random(num_seqs)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(2, 13))] for _ in range(num_seqs)]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(num_seqs)]
    slots = [i % 4 for i in range(num_seqs)]  # the base, then each adapter, and again

    def works_of(ids, positions):
        return [SequenceWork(f"r{i}", ids[i], positions[i], tables[i], True, GREEDY, lora_slot=slots[i])
                for i in range(num_seqs)]

    prefill = StepBatch(0, works_of(prompts, [0] * num_seqs), lora_loads=loads)
    first = runner.forward(prefill, use_graphs=False)
    next_ids = first[0].float().argmax(-1).tolist()
    positions = [len(p) for p in prompts]
    for step in range(1, 5):
        works = works_of([[t] for t in next_ids], positions)
        eager = runner.forward(StepBatch(step, works), use_graphs=False)[0].float()  # segment-wise
        runner.lora.batch.use_dense = True
        try:
            runner.lora.prepare_rows(works, graphs.padded_size(num_seqs))
            graph = graphs.run(works).float()
        finally:
            runner.lora.batch.use_dense = False
        assert float((graph - eager).abs().max() / eager.abs().max()) < 1e-5
        next_ids = eager.argmax(-1).tolist()
        positions = [p + 1 for p in positions]


def test_engine_on_the_graph_paths_with_adapters_matches_transformers_peft(
        tiny_checkpoints, lora_adapters, fake_mixed_graphs, monkeypatch) -> None:  # noqa: F811
    """The runner's decode- and mixed-graph branches (their static buffers run eagerly here, as
    CUDA replays them) with three adapters and the base mixed: transformers + peft's tokens."""

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 30))] for _ in range(4)]
    names = [None, *lora_adapters]
    monkeypatch.setattr("workers.runner_build.use_cuda_graphs", lambda config, device: True)
    monkeypatch.setattr("workers.runner_build.DecodeGraphs.capture", lambda self: None)  # run eagerly
    config = EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", device="cpu", block_size=4,
                          num_kv_blocks=256, max_num_seqs=2, max_num_batched_tokens=16,
                          cuda_graph_max_tokens=16, enable_lora=True, max_loras=3,
                          lora_modules={name: str(path) for name, path in lora_adapters.items()})
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLMEngine(config, load_tokenizer_files=False) as engine:
        runner = engine.executor.runner
        assert runner.lora.is_dense and runner.decode_graphs is not None and runner.mixed_graphs is not None
        decode_runs = []
        original = runner.decode_graphs.run
        runner.decode_graphs.run = lambda *a, **k: decode_runs.append(1) or original(*a, **k)
        results = engine.generate(prompts, greedy, lora_names=names)
        assert sum(g.num_replays for g in runner.mixed_graphs.graphs.values()) > 0 and decode_runs
    base = tiny_checkpoints["llama"]
    models = {name: load_hf_with_adapter(base, path) for name, path in lora_adapters.items()}
    models[None] = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    for prompt, name, result in zip(prompts, names, results, strict=True):
        assert_greedy_matches(result.token_ids, hf_greedy(models[name], prompt, 6), allow_near_tie=True)
