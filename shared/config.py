"""Configuration shared by every command: where tokenfleet keeps its files, engine knobs.

Engine defaults live in two layers, both here. `EngineConfig`'s dataclass defaults are the
CPU's (and the tests'): `EngineConfig(model=...)` is the same config on every machine. The
limits that depend on the hardware (max_num_seqs, max_num_batched_tokens, async_scheduling and
cuda_graph_max_batch_size, which follows max_num_seqs) are in `DEVICE_DEFAULTS`, applied by
`EngineConfig.for_device`: the commands build their config through it (tokenfleet/engine_flags.py,
from the same table their flags come from), and so should an in-process user that wants what
the commands get on its device. On CUDA the commands go through workers/card_sizing.py's
`config_for_device`, which reads the card and gives for_device a `BatchSizing`
(shared/batch_sizing.py): max_num_seqs and the largest graph by the card and the model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from shared.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from shared.batch_sizing import BatchSizing

ENV_PREFIX = "TOKENFLEET_"
# Where schedulers, gateways and the batch tools look for Redis when no --redis-url says otherwise.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
QUANTIZATIONS = ("fp8", "int8")  # what --quantization takes (workers/layers/quantization.py)
# What --kv-cache-dtype takes: "auto" (the serving dtype) or "fp8" (e4m3, docs/quantization.md).
KV_CACHE_DTYPES = ("auto", "fp8")
# Beside batch work (or any less important), a step takes at most this times what its more
# important work alone would (scheduler/step_budget.py), unless itl_target_ms says otherwise.
DEFAULT_ITL_SLOWDOWN = 1.4
# NVLink multicast (NVLS) off unless the environment says otherwise: on shared multi-GPU
# hosts a program that uses it can take every GPU of the host out of service. Set before
# NCCL (or PyTorch's symmetric memory) reads them, i.e. before a process group exists.
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1"}


def tokenfleet_home() -> Path:
    """$TOKENFLEET_HOME, default ~/.cache/tokenfleet (models, fleet.json, Redis data)."""
    return Path(os.environ.get(f"{ENV_PREFIX}HOME", Path.home() / ".cache" / "tokenfleet"))


def env_default(name: str, default: str | None = None) -> str | None:
    """The TOKENFLEET_<NAME> variable that backs a command-line flag."""
    return os.environ.get(f"{ENV_PREFIX}{name.upper().replace('-', '_')}", default)


@dataclass(frozen=True)
class DeviceDefaults:
    max_num_seqs: int  # running sequences (and the largest CUDA-graph decode batch)
    max_num_batched_tokens: int  # tokens per step
    # Plan step n+1 while the device runs step n (scheduler/engine.py). On a CPU the in-process
    # runner computes a step as it is submitted, so planning ahead overlaps nothing there and
    # only delays each step's tokens by one step's time: off.
    async_scheduling: bool


# Engine limits a config takes, by device type, when nobody sets them. On a GPU, decode
# throughput keeps growing up to ~512 sequences per step (scripts/bench_gpu.py, H200: 10.1k
# output tok/s at 512 against 7.9k at 256); a CPU is saturated long before. A GPU's max_num_seqs
# here is the fallback where its card is not known: the commands size it to the card and the
# model (shared/batch_sizing.py, workers/card_sizing.py).
DEVICE_DEFAULTS = {
    "cuda": DeviceDefaults(max_num_seqs=512, max_num_batched_tokens=8192, async_scheduling=True),
    "cpu": DeviceDefaults(max_num_seqs=256, max_num_batched_tokens=2048, async_scheduling=False),
}
_CPU = DEVICE_DEFAULTS["cpu"]


@dataclass
class EngineConfig:
    """Knobs of one engine (scheduler core + its worker group). The defaults are the CPU's;
    `for_device` gives a device's (see the module docstring)."""

    model: str  # path of a Hugging Face model folder
    tp: int = 1  # tensor-parallel ranks per pipeline stage
    pp: int = 1  # pipeline stages: the layers split into pp contiguous runs (Ray groups only)
    device: str | None = None  # None: cuda when present, else cpu
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None: sized from free memory
    kv_cache_memory_fraction: float = 0.9  # of free GPU memory (CUDA) for weights' leftovers
    kv_cache_bytes_cpu: int = 2 << 30  # KV budget on CPU when num_kv_blocks is None
    max_num_seqs: int = _CPU.max_num_seqs  # cap on running sequences
    max_num_batched_tokens: int = _CPU.max_num_batched_tokens  # per-step token budget (chunked prefill)
    max_model_len: int | None = None  # None: the model's context window
    # Reuse the KV blocks of prompt prefixes computed before (hash-addressed full blocks).
    enable_prefix_caching: bool = True
    # GiB of host memory (pinned on CUDA) per replica, split across its ranks, holding copies of
    # full KV blocks under the prefix cache (docs/kv-offloading.md); 0: no host tier.
    kv_offloading_size: float = 0.0
    # Submit step n+1 before collecting step n: sampled ids stay on the device and feed the next
    # step's inputs; stop checks act one step late (scheduler/scheduler.py). Ignored under
    # pipeline parallelism, whose steps in flight already overlap.
    async_scheduling: bool = _CPU.async_scheduling
    # Beside more important work (chats beside batch items; a higher priority beside a lower),
    # less important prefill fills a step only up to a latency budget (scheduler/step_budget.py):
    # this many ms per step; None: itl_slowdown times a step of the more important work alone, as
    # the engine's step cost model predicts; 0: no budget (batch prompts share steps with chats as they fit).
    itl_target_ms: float | None = None
    itl_slowdown: float = DEFAULT_ITL_SLOWDOWN
    num_threads: int | None = None  # torch threads per rank on CPU
    # Structured outputs: append the text a grammar forces (a key, a closing brace) without
    # sampling it (scheduler/grammar.py says how that can change a request's tokens).
    grammar_jump_forward: bool = False
    # Speculative decoding (--speculative-config, shared/speculative.py); None: off.
    speculative_config: SpeculativeConfig | None = None
    # CUDA graphs of decode-only steps (CUDA with Triton only; CPU always runs eagerly).
    cuda_graphs: bool = True
    cuda_graph_max_batch_size: int = _CPU.max_num_seqs  # decode batches above this run eagerly
    # Mixed steps (prefill chunks with decodes) of up to this many tokens replay a graph of their
    # token bucket (workers/mixed_graphs.py); larger ones run eagerly; 0: every mixed step eagerly.
    cuda_graph_max_tokens: int = 2048
    # Refuse to load when one rank's share of the weights needs more bytes than this
    # (checked before any weight is allocated); None: no limit.
    max_weight_bytes_per_rank: int | None = None
    # Linear weights quantized at load: "fp8" (e4m3, dynamic per-token activations) or "int8"
    # (weight-only). None: as the checkpoint stores them (an FP8 checkpoint stays FP8).
    quantization: str | None = None
    # K/V storage: "auto" (the serving dtype) or "fp8" (e4m3 with a per-layer scale: twice the
    # blocks of bf16 in the same memory; workers/layers/kv_fp8.py).
    kv_cache_dtype: str = "auto"
    # An FP8 cache's per-layer K/V scales (workers/layers/kv_scales.py): None (auto) measures them
    # in the first real step where the checkpoint has none; True measures them even where it has;
    # False never measures (the checkpoint's scales, else 1.0, vLLM's default).
    calculate_kv_scales: bool | None = None
    # Profiling: CUDA events around every step and collective (read through the rank
    # workers' collective_times()); steps then run eagerly, without CUDA graphs.
    time_collectives: bool = False
    seed: int = 0
    # LoRA adapters (docs/lora.md): off, nothing of the base path changes. lora_modules: name ->
    # PEFT folder, served from the start; max_loras adapters share a step (device slots),
    # max_cpu_loras stay read in host memory (None: max_loras); ranks above max_lora_rank are refused.
    enable_lora: bool = False
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Worker groups (Ray). Groups are used for tp * pp > 1, for replicas, or when use_ray is set.
    use_ray: bool = False
    ray_address: str | None = None  # None: a local Ray started by this process
    placement_strategy: str = "STRICT_PACK"  # PACK or SPREAD to allow ranks on several nodes
    num_cpus_per_rank: float = 1.0  # Ray CPUs of each rank's bundle on CPU hosts
    # A placement group someone else reserved for this engine (the autoscaler, by name, in
    # RAY_NAMESPACE): the group uses its bundles, and leaves removing it to its owner.
    placement_group_name: str | None = None
    step_timeout_s: float = 120.0  # a step slower than this means a rank is gone
    max_group_restarts: int = 3  # rebuilds of a failed worker group before giving up
    # "generate" (text) or "pooling" (embeddings: prefill only, one vector per input; vLLM's
    # --runner; shared/pooling_params.py, workers/pooling_runner.py).
    runner: str = "generate"

    @classmethod
    def for_device(cls, device_type: str, sizing: BatchSizing | None = None, **fields) -> EngineConfig:
        """The config of `fields` where max_num_seqs, max_num_batched_tokens, async_scheduling and
        cuda_graph_max_batch_size, left out or None, take the defaults of `device_type` ("cuda"
        or "cpu": workers.device.resolve_device(config.device).type); the largest graph batch
        follows max_num_seqs. `sizing`: the card's (workers.card_sizing.config_for_device), which
        then gives max_num_seqs and caps the graphs in place of the table."""
        defaults = DEVICE_DEFAULTS.get(device_type, _CPU)
        if fields.get("max_num_seqs") is None:
            fields["max_num_seqs"] = sizing.max_num_seqs if sizing else defaults.max_num_seqs
        if fields.get("max_num_batched_tokens") is None:
            fields["max_num_batched_tokens"] = defaults.max_num_batched_tokens
        if fields.get("async_scheduling") is None:
            fields["async_scheduling"] = defaults.async_scheduling
        if fields.get("cuda_graph_max_batch_size") is None:
            seqs = fields["max_num_seqs"]
            fields["cuda_graph_max_batch_size"] = sizing.graph_batch_for(seqs) if sizing else seqs
        return cls(**fields)


def uses_ray(executor: str, tp: int, pp: int = 1) -> bool:
    """Whether an engine runs its ranks as a Ray group. "auto" keeps one rank in the scheduler's
    own process: a Ray group there costs a hop per step and buys nothing a takeover does not."""
    return executor == "ray" or (executor == "auto" and tp * pp > 1)
