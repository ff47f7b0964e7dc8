"""workers/card_sizing.py on a host without CUDA: the CPU's config is the table's, a config that
gives both limits needs no card, and a card that cannot be read is a clear error naming the fix
(the rule itself: tests/shared/test_batch_sizing.py)."""

from __future__ import annotations

import pytest
import torch

from shared.config import EngineConfig
from shared.errors import ModelLoadError
from workers.card_sizing import card_bytes, config_for_device

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
