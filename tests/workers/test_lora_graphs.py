"""The dense LoRA path (every row against every slot, masked to its own: fixed shapes, what a
CUDA decode graph replays) against the segment-wise one, on this CPU: a decode graph's static
buffers, run eagerly, give the eager step's logits with three adapters and the base mixed."""

from __future__ import annotations

import random

import pytest

from shared.config import EngineConfig
from shared.sampling import SamplingParams
from shared.step import LoraLoad, SequenceWork, StepBatch
from workers.cuda_graphs import DecodeGraphs
from workers.model_runner import ModelRunner
from workers.parallel import SINGLE_DEVICE

GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize("num_seqs", [3, 6])
def test_decode_graph_rows_with_adapters_match_the_eager_segments(num_seqs, tiny_checkpoints,
                                                                  lora_adapters) -> None:
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
