"""The pooling runner where it takes longer: tensor parallelism on a real local Ray (TP=2), and
the default model (SmolLM2, text through its own tokenizer), judged against transformers."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from testkit.checkpoints import make_tiny_bert, make_tiny_checkpoint, write_sentence_transformers_files
from tests.workers.test_pooling_models import _assert_close, _prompts, _reference

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["qwen2", "bert"])
def test_tensor_parallel_embeddings_match_transformers(tmp_path, family):
    folder = (make_tiny_bert(tmp_path / family) if family == "bert"
              else make_tiny_checkpoint(family, tmp_path / family))
    write_sentence_transformers_files(folder, "mean", normalize=True)
    prompts = _prompts(7)
    config = EngineConfig(model=str(folder), runner="pooling", tp=2, dtype="float32", num_kv_blocks=64,
                          max_num_batched_tokens=16, max_num_seqs=8)
    with LLMEngine(config, load_tokenizer_files=False) as engine:
        results = engine.embed(prompts)
    _assert_close([r.embedding for r in results], _reference(folder, prompts, "mean", True), same_norm=True)


def test_the_default_model_embeds_text_as_transformers_does(smollm2: Path, tmp_path):
    from transformers import AutoTokenizer

    texts = ["The quick brown fox jumps over the lazy dog.", "Embeddings for search", "Bonjour"]
    folder = Path(shutil.copytree(smollm2, tmp_path / "smollm2"))
    ids = [AutoTokenizer.from_pretrained(folder)(text).input_ids for text in texts]
    config = EngineConfig(model=str(folder), runner="pooling", dtype="float32", num_kv_blocks=64)
    with LLMEngine(config) as engine:
        results = engine.embed(texts)
    assert [r.num_prompt_tokens for r in results] == [len(i) for i in ids]
    _assert_close([r.embedding for r in results], _reference(folder, ids, "last", True))
    assert all(np.linalg.norm(r.embedding) == pytest.approx(1.0, abs=1e-5) for r in results)
