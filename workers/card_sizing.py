"""The engine config of a device whose card is read: max_num_seqs and the largest CUDA graph from
the card's memory and the model (the rule and its figures: shared/batch_sizing.py)."""

from __future__ import annotations

import torch

from shared.batch_sizing import BatchSizing, sizing_for
from shared.config import EngineConfig
from shared.logging import get_logger
from shared.model_config import load_model_config

log = get_logger(__name__)


def card_bytes(device: torch.device) -> int:
    """The card's total memory as the driver reports it (the device's index, else the current one)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).total_memory


def config_for_device(card: torch.device, **fields) -> EngineConfig:
    """EngineConfig.for_device of `fields` on the device `card` (resolved from fields' `device`); on
    CUDA the limits left out are sized to the card and the model, and the choice is logged with
    what made it (a user's values win)."""
    config = EngineConfig.for_device(card.type, **fields)
    if card.type != "cuda" or config.runner != "generate":
        return config
    sizing = card_sizing(config, card_bytes(card))
    config = EngineConfig.for_device(card.type, sizing=sizing, **fields)
    log.info("batch_sizing", max_num_seqs=config.max_num_seqs,
             cuda_graph_max_batch_size=config.cuda_graph_max_batch_size,
             max_num_seqs_given=fields.get("max_num_seqs") is not None,
             cuda_graph_max_batch_size_given=fields.get("cuda_graph_max_batch_size") is not None,
             reason=sizing.reason)
    return config


def card_sizing(config: EngineConfig, total_bytes: int) -> BatchSizing:
    return sizing_for(config, load_model_config(config.model), total_bytes)
