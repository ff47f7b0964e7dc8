"""The engine config of a device whose card is read: max_num_seqs and the largest CUDA graph from
the card's memory and the model (the rule and its figures: shared/batch_sizing.py)."""

from __future__ import annotations

import subprocess
import sys

import torch

from shared.batch_sizing import sizing_for
from shared.config import EngineConfig
from shared.errors import ModelLoadError
from shared.logging import get_logger
from shared.model_config import load_model_config

log = get_logger(__name__)

_PROBE = "import sys, torch; print(torch.cuda.get_device_properties(int(sys.argv[1])).total_memory)"


def card_bytes(card: torch.device) -> int:
    """The card's total memory as the driver reports it. Read in a short-lived process unless
    this one holds a CUDA context already: a Ray group's driver never uses the GPU, and a
    context opened there would take ~0.5 GB of the card its first rank sizes its KV cache on."""
    index = card.index if card.index is not None else 0
    if torch.cuda.is_initialized():
        return torch.cuda.get_device_properties(index).total_memory
    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE, str(index)], capture_output=True, text=True,
                               timeout=120)
        why = (probe.stderr.strip().splitlines() or ["no output"])[-1] if probe.returncode else None
        if why is None and probe.stdout.split() and probe.stdout.split()[-1].isdigit():
            return int(probe.stdout.split()[-1])
        why = why or f"it printed {probe.stdout.strip()[-200:]!r}"
    except (subprocess.TimeoutExpired, OSError) as error:
        why = str(error)
    raise ModelLoadError(f"could not read the memory of {card} to size max_num_seqs ({why}); give "
                         "--max-num-seqs and --cuda-graph-max-batch-size to choose them yourself")


def config_for_device(card: torch.device, **fields) -> EngineConfig:
    """EngineConfig.for_device of `fields` on the device `card` (resolved from fields' `device`); on
    CUDA the limits left out are sized to the card and the model (a user's values win)."""
    given = [fields.get(name) is not None for name in ("max_num_seqs", "cuda_graph_max_batch_size")]
    if card.type != "cuda" or fields.get("runner", "generate") != "generate" or all(given):
        return EngineConfig.for_device(card.type, **fields)
    return sized_config(card.type, card_bytes(card), **fields)


def sized_config(device_type: str, total_bytes: int, **fields) -> EngineConfig:
    """EngineConfig.for_device of `fields` with max_num_seqs and the largest graph, where left
    out, sized to a card of `total_bytes` and the model folder; the choice is logged with what
    made it."""
    config = EngineConfig.for_device(device_type, **fields)
    sizing = sizing_for(config, load_model_config(config.model), total_bytes)
    config = EngineConfig.for_device(device_type, sizing=sizing, **fields)
    log.info("batch_sizing", max_num_seqs=config.max_num_seqs,
             cuda_graph_max_batch_size=config.cuda_graph_max_batch_size,
             max_num_seqs_given=fields.get("max_num_seqs") is not None,
             cuda_graph_max_batch_size_given=fields.get("cuda_graph_max_batch_size") is not None,
             reason=sizing.reason)
    return config
