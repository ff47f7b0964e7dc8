"""Pipeline stages on different Ray nodes: two nodes on this machine with one CPU each, so the
two stages of a PP=2 group (one rank of one CPU each) cannot share a node. The group still
decodes exactly as transformers does."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.hf_reference import assert_greedy_matches, hf_greedy
from tests.tokenfleet.test_autoscale_placement import two_ray_nodes  # noqa: F401 - a fixture

pytestmark = pytest.mark.slow
NUM_TOKENS = 16

# In a process of its own: this one may have joined a local Ray already.
ENGINE_ON_CLUSTER = """
import json, sys
from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams

address, model, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
config = EngineConfig(model=model, pp=2, dtype="float32", block_size=4, num_kv_blocks=128, max_num_seqs=8,
                      max_num_batched_tokens=32, use_ray=True, ray_address=address)
with LLMEngine(config, load_tokenizer_files=False) as engine:
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=int(sys.argv[4]),
                                                      ignore_eos=True))
    nodes = [info.node_id for info in engine.executor.infos]
print(json.dumps({"tokens": [r.token_ids for r in results], "nodes": nodes}))
"""


def test_the_two_stages_run_on_two_nodes_and_decode_as_transformers(two_ray_nodes, tiny_checkpoints):  # noqa: F811
    address, env = two_ray_nodes
    folder = tiny_checkpoints["llama"]
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 20))] for _ in range(3)]
    run = subprocess.run([sys.executable, "-c", ENGINE_ON_CLUSTER, address, str(folder), json.dumps(prompts),
                          str(NUM_TOKENS)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(set(found["nodes"])) == 2, found["nodes"]  # stage 0 and stage 1 on different nodes
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for tokens, prompt in zip(found["tokens"], prompts, strict=True):
        assert_greedy_matches(tokens, hf_greedy(hf, prompt, NUM_TOKENS), allow_near_tie=False)
