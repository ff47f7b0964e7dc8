"""How a rank's model runner is built: its model (quantization, the weight budget, LoRA slots),
its KV cache (sized from the memory left, one scratch block more), its device block tables and
its CUDA graphs. A part of `ModelRunner` (model_runner.py), which calls these in its constructor.
"""

from __future__ import annotations

import gc
import time

import torch

from shared.batch_sizing import activation_reserve_bytes
from shared.config import EngineConfig
from shared.errors import ModelLoadError
from shared.model_config import ModelConfig
from workers.cuda_graphs import DecodeGraphs, use_cuda_graphs
from workers.device_block_tables import DeviceBlockTables
from workers.host_kv_pool import HostKVPool
from workers.layers.quantization import METHODS, building_with, method_named
from workers.lora.manager import LoraManager
from workers.mixed_graphs import MixedGraphs
from workers.models.registry import MODEL_CLASSES
from workers.parallel import all_reduce_min
from workers.weight_loader import load_weights, resident_weight_bytes


def format_bytes(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.2f} MB"


def kv_blocks_for_budget(free_bytes: int, *, fraction: float, activation_bytes: int, block_bytes: int) -> int:
    """KV blocks a rank can hand out: `fraction` of `free_bytes`, less room for the largest step's
    activations, less the scratch block. On CUDA `free_bytes` is what the driver reports free, so
    whatever an earlier runner in the process still holds comes off this budget: that is why
    `ModelRunner.close` gives everything back."""
    budget = int(free_bytes * fraction) - activation_bytes
    return max(0, budget // block_bytes - 1)


def kv_blocks_on_rank(config: EngineConfig, device: torch.device, world_size: int, *, block_bytes: int,
                      activation_bytes: int) -> int:
    """The KV blocks every rank of the group can hold (the smallest rank's count): on CUDA from what
    the driver reports free less `activation_bytes`, on a CPU from `kv_cache_bytes_cpu`."""
    if device.type == "cuda":
        # Blocks PyTorch caches but does not use (a closed engine's, say) are free for this
        # cache too, but the driver counts them as taken until they are handed back.
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        local = kv_blocks_for_budget(free, fraction=config.kv_cache_memory_fraction,
                                     activation_bytes=activation_bytes, block_bytes=block_bytes)
    else:
        local = kv_blocks_for_budget(config.kv_cache_bytes_cpu, fraction=1.0, activation_bytes=0,
                                     block_bytes=block_bytes)
    num_blocks = all_reduce_min(world_size, local)
    if num_blocks < 1:
        raise ModelLoadError("no memory is left for the KV cache after loading the weights")
    return num_blocks


def resolve_quantization(requested: str | None, model_config: ModelConfig,
                         device: torch.device) -> str | None:
    """The quantization to run: the flag's, or the checkpoint's own when it stores one."""
    stored = model_config.checkpoint_quantization
    if requested is not None and requested not in METHODS:
        raise ModelLoadError(f"unknown quantization {requested!r}; choose one of {sorted(METHODS)}")
    if stored and requested not in (None, stored):
        raise ModelLoadError(f"the checkpoint stores {stored} weights; it cannot run as {requested}")
    chosen = requested or stored
    refusal = METHODS[chosen].refusal_on(device) if chosen else None
    if refusal:
        raise ModelLoadError(refusal)
    return chosen


def release_device_memory(device: torch.device) -> None:
    """Collect reference cycles, then hand the caching allocator's free blocks (a destroyed CUDA
    graph pool's included) back to the driver, where the next KV cache sizing can see them."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def free_cache_and_weights(runner) -> None:
    """The tail of a runner's close: its KV cache's storage emptied (views of it no longer keep
    it), its weights moved to the meta device, the memory handed back (`release_device_memory`)."""
    if runner.kv_caches is not None:
        with torch.no_grad():
            runner.kv_caches.set_()  # an empty storage: the cache's memory is free now
    runner.kv_caches = None
    if runner.model is not None:
        runner.model.to_empty(device="meta")
    runner.model = None
    release_device_memory(runner.device)
    runner.log.info("runner_closed", device=str(runner.device))


class RunnerBuild:
    def _wrap_lora(self) -> LoraManager | None:
        """The model's projections wrapped with adapter slots (workers/lora/), before the KV cache
        is sized (the slots' memory comes off its budget)."""
        config = self.config
        if not config.enable_lora:
            return None
        if self.quantization:
            raise ModelLoadError("LoRA adapters are served on unquantized weights only; "
                                 f"drop quantization={self.quantization!r} or --enable-lora")
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            # With CUDA graphs the dense path (fixed shapes: the graphs replay it); else segment-wise.
            max_rows = max(config.max_num_batched_tokens, config.max_num_seqs)
            manager = LoraManager(self.model, self.model_config, config.model, max_loras=config.max_loras,
                                  max_lora_rank=config.max_lora_rank,
                                  max_cpu_loras=config.max_cpu_loras or config.max_loras, max_rows=max_rows,
                                  device=self.device, dense=use_cuda_graphs(config, self.device),
                                  upload=self.staging.upload)
        finally:
            torch.set_default_dtype(previous)
        self.log.info("lora_slots_allocated", max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                      bytes=manager.slot_bytes)
        return manager

    def _new_model(self, device: torch.device) -> torch.nn.Module:
        cls = MODEL_CLASSES[self.model_config.model_type]
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)  # parameters are born in the serving dtype
        try:
            with torch.device(device), building_with(method_named(self.quantization)):
                return cls(self.model_config, self.tp, self.max_model_len, self.stage)
        except ValueError as exc:  # e.g. heads that do not divide by TP
            raise ModelLoadError(f"cannot shard {self.config.model!r}: {exc}") from None
        finally:
            torch.set_default_dtype(previous)

    def weight_bytes_needed(self) -> int:
        """Bytes of this rank's weight shard, from the model's shapes alone (a meta-device
        model: nothing is allocated, nothing read)."""
        return resident_weight_bytes(self._new_model(torch.device("meta")))

    def _check_weight_budget(self) -> None:
        budget = self.config.max_weight_bytes_per_rank
        if budget is None:
            return
        need = self.weight_bytes_needed()
        if need > budget:
            stage = self.stage
            where = f" in pipeline stage {stage.index} of pp={stage.size}" if stage.size > 1 else ""
            raise ModelLoadError(
                f"the weights of {self.config.model!r} do not fit: rank {self.tp.rank} of "
                f"tp={self.tp.size}{where} "
                f"needs {format_bytes(need)} for its shard ({self.dtype}"
                f"{', ' + self.quantization + ' linear weights' if self.quantization else ''}), over "
                f"max_weight_bytes_per_rank = {format_bytes(budget)}; shard it over more ranks "
                f"(about tp={-(-need * self.tp.size // budget)}, or more pipeline stages) or raise the budget"
            )

    def _build_model(self) -> torch.nn.Module:
        start = time.perf_counter()
        model = self._new_model(self.device)
        load_weights(model, self.config.model)
        model.eval()
        self.log.info(
            "model_loaded", model=self.config.model, device=str(self.device), dtype=str(self.dtype),
            quantization=self.quantization,
            weight_bytes=resident_weight_bytes(model), seconds=round(time.perf_counter() - start, 2),
        )
        return model

    @property
    def num_stage_layers(self) -> int:
        """The layers this rank holds, and keeps KV for: its pipeline stage's."""
        return len(self.stage.layers(self.model_config.num_layers))

    @property
    def kv_block_bytes(self) -> int:
        cfg = self.model_config
        kv_heads = self.tp.shard(cfg.num_kv_heads)[1]
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return 2 * self.num_stage_layers * self.block_size * kv_heads * cfg.head_dim * elem

    def _decide_num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        # (the same reserve shared/batch_sizing.py assumes when it sizes max_num_seqs)
        mixed_tokens = self._mixed_graph_tokens() if self.device.type == "cuda" else 0
        activations = activation_reserve_bytes(self.model_config.hidden_size,
                                               self.config.max_num_batched_tokens, mixed_tokens)
        return kv_blocks_on_rank(self.config, self.device, self.world_size, block_bytes=self.kv_block_bytes,
                                 activation_bytes=activations)

    def _allocate_kv_cache(self) -> torch.Tensor:
        cfg = self.model_config
        # Block num_kv_blocks is the scratch block: padded rows of graph steps write there.
        shape = (self.num_stage_layers, 2, self.num_kv_blocks + 1, self.block_size,
                 self.tp.shard(cfg.num_kv_heads)[1], cfg.head_dim)
        self.log.info("kv_cache_allocated", num_blocks=self.num_kv_blocks, dtype=str(self.kv_dtype),
                      bytes=(self.num_kv_blocks + 1) * self.kv_block_bytes)
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def _allocate_host_kv(self) -> HostKVPool | None:
        """The host tier's pool (workers/host_kv_pool.py): its share of kv_offloading_size, in
        blocks of its shard, the same number on every rank; None when the tier is off."""
        size = self.config.kv_offloading_size
        if not size:
            return None
        if not self.config.enable_prefix_caching:
            raise ModelLoadError("--kv-offloading-size needs prefix caching (the host tier sits under it); "
                                 "drop --no-prefix-caching or the tier")
        local = int(size * 2**30 / self.world_size) // self.kv_block_bytes
        num_blocks = all_reduce_min(self.world_size, local)
        if num_blocks < 1:
            raise ModelLoadError(f"--kv-offloading-size {size} GiB holds no KV block "
                                 f"({self.kv_block_bytes * self.world_size} bytes over the replica's ranks)")
        start = time.perf_counter()
        pool = HostKVPool(self.kv_caches, num_blocks)
        self.log.info("host_kv_pool_allocated", num_blocks=num_blocks, bytes=num_blocks * pool.block_bytes,
                      pinned=pool.pool.is_pinned(), seconds=round(time.perf_counter() - start, 2))
        return pool

    @property
    def num_host_kv_blocks(self) -> int:
        return self.host_kv.num_blocks if self.host_kv is not None else 0

    @property
    def kv_cache_bytes(self) -> int:
        if self.kv_caches is None:  # closed
            return 0
        return self.kv_caches.numel() * self.kv_caches.element_size()

    def _new_block_tables(self) -> DeviceBlockTables:
        # Spare rows: under async scheduling a request's leaving is announced a step or two late,
        # while newcomers already take rows (and the tables take back the oldest unused if need be).
        max_rows = self.config.max_num_seqs + min(self.config.max_num_seqs, 64)
        return DeviceBlockTables(max_rows, -(-self.max_model_len // self.block_size),
                                 pad_block=self.num_kv_blocks, device=self.device)  # the scratch block

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        if not use_cuda_graphs(self.config, self.device) or self.tp.timer is not None:
            return None
        if self.lora is not None and not self.lora.is_dense:  # (never: graphs make it dense)
            return None
        graphs = DecodeGraphs(
            self.model, self.kv_caches, block_size=self.block_size, max_model_len=self.max_model_len,
            scratch_block=self.num_kv_blocks,
            max_batch_size=min(self.config.cuda_graph_max_batch_size, self.config.max_num_seqs),
            device=self.device, dtype=self.dtype, tables=self.block_tables, staging=self.staging,
        )
        return self._captured(graphs, "cuda_graphs")

    def _mixed_graph_tokens(self) -> int:
        """The largest mixed step a graph replays; 0: none."""
        if not use_cuda_graphs(self.config, self.device) or self.tp.timer is not None:
            return 0
        return min(self.config.cuda_graph_max_tokens, self.config.max_num_batched_tokens)

    def _capture_mixed_graphs(self) -> MixedGraphs | None:
        max_tokens = self._mixed_graph_tokens()
        if max_tokens <= 0:
            return None
        graphs = MixedGraphs(
            self.model, self.kv_caches, block_size=self.block_size, max_model_len=self.max_model_len,
            scratch_block=self.num_kv_blocks, max_tokens=max_tokens,
            num_decode_slots=self.config.max_num_seqs, hidden_size=self.model_config.hidden_size,
            device=self.device, dtype=self.dtype, tables=self.block_tables, staging=self.staging,
        )
        return self._captured(graphs, "mixed_graphs")

    def _captured(self, graphs: DecodeGraphs | MixedGraphs, name: str):
        """`graphs` once captured on every rank; None (eager steps) when any rank failed."""
        start = time.perf_counter()
        try:
            graphs.capture()
            captured = 1
        except Exception as exc:  # noqa: BLE001 - a capture failure costs speed, not service
            self.log.warning(f"{name}_capture_failed", error=f"{type(exc).__name__}: {exc}"[:500])
            captured = 0
        if not all_reduce_min(self.world_size, captured):  # every rank must take the same path
            graphs.close()
            return None
        self.log.info(f"{name}_captured", sizes=len(graphs.sizes), largest=graphs.sizes[-1],
                      seconds=round(time.perf_counter() - start, 2))
        return graphs
