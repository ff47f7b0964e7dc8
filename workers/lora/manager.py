"""A runner's adapters: the model's projections wrapped, `max_loras` device slots, and the
adapters read from disk kept in a host cache of `max_cpu_loras`, least recently used out first.

Which adapter sits in which slot is the scheduler's decision (scheduler/lora_slots.py): a step
names the loads it needs (`StepBatch.lora_loads`) and each work its slot, so every rank of a
group holds the same adapters in the same slots. A load from the host cache copies the
adapter's file bytes to the device in one transfer and fills the slot from views of them there;
a miss reads the file first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from shared.lora_config import read_lora_config
from shared.model_config import ModelConfig
from shared.step import LoraLoad, SequenceWork
from workers.lora.adapter import LoraAdapter, load_adapter
from workers.lora.layers import LoraBatch, LoraProjection, SlotGroup, SubProjection
from workers.step_inputs import eager_order

# our fused module -> the PEFT projections it holds, in its output order
_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
           "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


def _subs(module_name: str, base: nn.Module) -> tuple[list[SubProjection], int]:
    """The sub-projections of one wrapped linear on this rank, and its input width here."""
    names = _PACKED[module_name]
    in_features = base.weight.shape[1]
    if len(names) == 1:  # row-parallel: this rank's input columns, every output row
        out = base.weight.shape[0]
        return [SubProjection(names[0], 0, (0, out), (base.in_start, base.in_per_rank))], in_features
    subs, offset = [], 0
    for name, (start, size) in zip(names, base.shards, strict=True):
        subs.append(SubProjection(name, offset, (start, size), None))
        offset += size
    return subs, in_features


class LoraManager:
    def __init__(self, model: nn.Module, base: ModelConfig, base_path: str, *, max_loras: int,
                 max_lora_rank: int, max_cpu_loras: int, max_rows: int, device: torch.device,
                 upload: Callable[[np.ndarray], torch.Tensor], dense: bool = False) -> None:
        """`max_rows`: the most rows a step has (tokens, or a decode graph's padded batch);
        `dense`: every step through the dense path (CUDA: graphs replay it), else segment-wise;
        `upload`: the runner's HostStaging.upload (int64 arrays to the device without waiting:
        a plain copy from pageable memory waits for the device's queue)."""
        self.base = base
        self.base_path = base_path
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.device = device
        self.num_slots = max_loras + 1  # slot 0: the base, no adapter
        self.batch = LoraBatch(token_slots=torch.zeros(max_rows, dtype=torch.long, device=device),
                               use_dense=dense)
        # (layer index, our module name) -> its wrapper
        self.projections: dict[tuple[int, str], LoraProjection] = {}
        self.slot_adapter: list[int | None] = [None] * self.num_slots  # slot -> adapter id in it
        self.slot_rank = [0] * self.num_slots  # slot -> the rank of its adapter
        self.host: OrderedDict[int, LoraAdapter] = OrderedDict()  # adapter id -> tensors, LRU first
        self.last_load_ms = 0.0
        self._num_filled = 0  # rows of batch.token_slots the last step filled
        self._upload = upload
        self._wrap(model)

    def _wrap(self, model: nn.Module) -> None:
        for index, layer in enumerate(model.model.layers):
            if not hasattr(layer, "self_attn"):  # another pipeline stage's layer
                continue
            for parent in (layer.self_attn, layer.mlp):
                for module_name in _PACKED:
                    base = getattr(parent, module_name, None)
                    if base is None:
                        continue
                    subs, in_features = _subs(module_name, base)
                    wrapper = LoraProjection(base, subs, in_features, self.num_slots, self.max_lora_rank,
                                             self.batch)
                    setattr(parent, module_name, wrapper)
                    self.projections[(index, module_name)] = wrapper

    # -- adapters into slots -------------------------------------------------------

    def apply_loads(self, loads: list[LoraLoad]) -> None:
        for load in loads:
            self.load(load)

    def load(self, load: LoraLoad) -> None:
        """Put the adapter in its slot (nothing to do when it sits there already)."""
        if self.slot_adapter[load.slot] == load.adapter_id:
            return
        start = time.perf_counter()
        adapter = self._host_adapter(load)
        # One host-to-device copy of the whole file, then device copies into the slot (on CPU
        # the host bytes themselves): a few hundred small host copies took most of a load.
        weights = adapter.pairs(adapter.data.to(self.device))
        for (layer, _), projection in self.projections.items():
            pairs = [weights.get((layer, sub.name)) for sub in projection.subs]
            projection.load_slot(load.slot, pairs, adapter.scaling)
        self.slot_adapter[load.slot] = load.adapter_id
        self.slot_rank[load.slot] = adapter.rank
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the time below includes the device's copies
        self.last_load_ms = (time.perf_counter() - start) * 1000

    def _host_adapter(self, load: LoraLoad) -> LoraAdapter:
        adapter = self.host.get(load.adapter_id)
        if adapter is not None:
            self.host.move_to_end(load.adapter_id)
            return adapter
        config = read_lora_config(load.path, self.base, base_path=self.base_path,
                                  max_lora_rank=self.max_lora_rank)
        adapter = load_adapter(load.name, config, self.base)
        self.host[load.adapter_id] = adapter
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter

    # -- the step's tokens by slot -------------------------------------------------

    @property
    def slot_bytes(self) -> int:
        """Device bytes of every slot of every wrapped projection (this rank's)."""
        tensors = [t for w in self.projections.values() for t in (w.lora_a, w.lora_bt)]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def is_dense(self) -> bool:
        return self.batch.use_dense

    def prepare(self, works: list[SequenceWork], device: torch.device) -> None:
        """The eager step's rows (works in eager_order, tokens in order) by slot."""
        ordered = [works[i] for i in eager_order(works)]
        slots = np.fromiter((w.lora_slot for w in ordered), dtype=np.int64, count=len(ordered))
        lens = np.fromiter((len(w.token_ids) for w in ordered), dtype=np.int64, count=len(ordered))
        for slot in np.unique(slots[slots > 0]).tolist():
            if self.slot_adapter[slot] is None:
                raise RuntimeError(f"LoRA slot {slot} is used by a step but holds no adapter")
        per_token = np.repeat(slots, lens)
        if self.batch.use_dense:
            self._fill_token_slots(per_token)
            return
        groups: list[SlotGroup] = []
        for slot in np.unique(slots[slots > 0]).tolist():
            rows = np.flatnonzero(per_token == slot)
            if rows[-1] - rows[0] + 1 == len(rows):  # consecutive: a view, no gather
                rows = slice(int(rows[0]), int(rows[-1]) + 1)
            else:
                rows = torch.from_numpy(rows).to(device)
            groups.append(SlotGroup(slot, rows))
        self.batch.groups = groups

    def prepare_rows(self, works: list[SequenceWork], num_rows: int) -> None:
        """A decode graph's rows: one per work in batch order, then padding (the base) up to
        `num_rows`. Dense only."""
        per_row = np.zeros(num_rows, dtype=np.int64)
        per_row[: len(works)] = [w.lora_slot for w in works]
        self._fill_token_slots(per_row)

    def _fill_token_slots(self, per_row: np.ndarray) -> None:
        """Rows past `per_row` become the base's (a mixed graph's padding rows read them)."""
        slots = self.batch.token_slots
        if len(per_row) > len(slots):
            raise ValueError(f"a step of {len(per_row)} rows; the LoRA slot buffer holds {len(slots)}")
        self.batch.groups = []
        filled, num_rows = len(per_row), max(len(per_row), self._num_filled)
        if num_rows > filled:  # the last step's further rows go back to the base
            per_row = np.concatenate([per_row, np.zeros(num_rows - filled, dtype=np.int64)])
        # One copy behind the step's other uploads: a plain copy from host memory would make the
        # host wait for the step before it.
        slots[:num_rows].copy_(self._upload(per_row))
        self._num_filled = filled
