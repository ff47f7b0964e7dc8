"""workers/card_sizing.py: a config sized to a card of a given size from a model folder, where a
user's values win; on a host without CUDA, the CPU's config is the table's, a config that gives
both limits needs no card, and a card that cannot be read is a clear error naming the fix (the
rule itself: tests/shared/test_batch_sizing.py)."""

from __future__ import annotations

import pytest
import torch

from shared.batch_sizing import GIB
from shared.config import EngineConfig
from shared.errors import ModelLoadError
from testkit.checkpoints import make_tiny_checkpoint
from workers.card_sizing import card_bytes, config_for_device, sized_config

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without CUDA")


def test_a_cpu_config_takes_the_cpu_defaults():
    assert config_for_device(torch.device("cpu"), model="m") == EngineConfig.for_device("cpu", model="m")


@no_cuda
def test_both_limits_given_need_no_card():
    config = config_for_device(torch.device("cuda"), model="m", max_num_seqs=48, cuda_graph_max_batch_size=16)
    assert (config.max_num_seqs, config.cuda_graph_max_batch_size) == (48, 16)


@no_cuda
def test_a_card_that_cannot_be_read_names_the_flags_that_skip_it():
    with pytest.raises(ModelLoadError, match="--max-num-seqs and --cuda-graph-max-batch-size"):
        card_bytes(torch.device("cuda", 0))
    assert not torch.cuda.is_initialized()  # read in a process of its own


def _llama_8b_shape(folder):
    """A config.json of Llama-3-8B's shape (sizing reads the shape only; no weights needed)."""
    import json

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}))
    return str(folder)


def test_an_80_gib_card_sizes_an_8b_model_to_1024_and_a_users_values_win(tmp_path):
    model = _llama_8b_shape(tmp_path / "llama8b")
    card = int(79.1 * GIB)
    chosen = sized_config("cuda", card, model=model)
    assert (chosen.max_num_seqs, chosen.cuda_graph_max_batch_size) == (1024, 512)
    given = sized_config("cuda", card, model=model, max_num_seqs=96)
    assert (given.max_num_seqs, given.cuda_graph_max_batch_size) == (96, 96)
    graphs = sized_config("cuda", card, model=model, cuda_graph_max_batch_size=1024)
    assert (graphs.max_num_seqs, graphs.cuda_graph_max_batch_size) == (1024, 1024)
    a100 = sized_config("cuda", int(39.4 * GIB), model=model)
    assert (a100.max_num_seqs, a100.cuda_graph_max_batch_size) == (304, 256)


def test_a_tiny_model_on_a_24_gib_card_takes_the_tier(tmp_path):
    folder = make_tiny_checkpoint("llama", tmp_path / "tiny")
    config = sized_config("cuda", int(23.6 * GIB), model=str(folder))
    assert (config.max_num_seqs, config.cuda_graph_max_batch_size) == (256, 128)


def test_a_probe_that_cannot_run_is_a_load_error_naming_the_flags(monkeypatch):
    import subprocess

    from workers import card_sizing

    def hangs(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], 120)

    monkeypatch.setattr(card_sizing.torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(card_sizing.subprocess, "run", hangs)
    with pytest.raises(ModelLoadError, match="--max-num-seqs"):
        card_sizing.card_bytes(torch.device("cuda", 0))
