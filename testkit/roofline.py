"""The hardware, measured in the same run (matrix rate, copy and read bandwidth), a model's
sizes, and the floors (roofline) of a workload at those rates. torch is imported on first use."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from testkit.workloads import Workload

if TYPE_CHECKING:
    import torch


def sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn, device: torch.device, min_seconds: float = 1.0, min_calls: int = 3) -> float:
    """After a warm-up call, repeat fn for at least min_seconds; synchronising rarely (batches
    of up to 64 calls), so a GPU stays busy while the host checks the clock."""
    fn()
    sync(device)
    calls, batch, start = 0, 1, time.perf_counter()
    while True:
        for _ in range(batch):
            fn()
        calls += batch
        sync(device)
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds and calls >= min_calls:
            return elapsed / calls
        batch = min(2 * batch, 64)


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int, min_seconds: float = 1.0) -> float:
    """FLOP/s of a size^3 matrix product on random data."""
    import torch

    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return 2 * size**3 / seconds_per_call(lambda: a @ b, device, min_seconds)


def copy_bandwidth(device: torch.device, num_bytes: int, min_seconds: float = 1.0) -> float:
    """Bytes/s of a copy of num_bytes, counting bytes read and written."""
    import torch

    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * num_bytes / seconds_per_call(lambda: dst.copy_(src), device, min_seconds)


def read_bandwidth(device: torch.device, num_bytes: int, min_seconds: float = 1.0) -> float:
    """Bytes/s of reading num_bytes (a sum): one tensor far larger than the caches."""
    import torch

    x = torch.ones(num_bytes // 4, device=device)
    return num_bytes / seconds_per_call(x.sum, device, min_seconds)


@dataclass(frozen=True)
class ModelShape:
    """The sizes the floors need, named as in shared.model_config.ModelConfig."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        """From a ModelConfig, or from a dict of transformers config fields (LLAMA3_8B)."""
        if not isinstance(config, dict):
            return cls(config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads,
                       config.num_kv_heads, config.head_dim, config.vocab_size, config.tie_word_embeddings)
        heads = config["num_attention_heads"]
        return cls(config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"], heads,
                   config["num_key_value_heads"], config.get("head_dim") or config["hidden_size"] // heads,
                   config["vocab_size"], config.get("tie_word_embeddings", False))

    @property
    def layer_matrix_params(self) -> int:
        """One layer's matrices: qkv_proj, o_proj, gate, up and down."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (self.hidden_size * (q_size + 2 * kv_size) + q_size * self.hidden_size
                + 3 * self.hidden_size * self.intermediate_size)

    @property
    def num_params(self) -> int:
        """Every parameter (no biases): embeddings, LM head unless tied, layers with their two norms,
        the final norm."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        per_layer = self.layer_matrix_params + 2 * self.hidden_size
        return embeddings + self.num_layers * per_layer + self.hidden_size

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


def dense_flops(num_params: int, workload: Workload) -> float:
    """2 FLOPs per parameter per prompt and output token: the GPU target's definition (LM head
    for every token, attention left out)."""
    return 2.0 * num_params * (workload.num_prompt_tokens + workload.num_output_tokens)


def exact_flops(shape: ModelShape, workload: Workload) -> tuple[float, float]:
    """(linear, attention) FLOPs: every layer's weights for every token, the LM head only where
    a token is sampled (the last prompt position counts as the first output), and causal
    attention's QK^T and AV; embeddings are lookups and norms are negligible."""
    num_tokens = workload.num_prompt_tokens + workload.num_output_tokens
    linear = (2.0 * shape.num_layers * shape.layer_matrix_params * num_tokens
              + 2.0 * shape.vocab_size * shape.hidden_size * workload.num_output_tokens)
    # The token at position p attends to p + 1 keys: 2 FLOPs per (head, dim, key) for QK^T and as
    # many for AV. Summed over a sequence of n tokens: n (n + 1) / 2 keys.
    key_visits = sum((n := len(p) + m) * (n + 1) // 2
                     for p, m in zip(workload.prompts, workload.max_tokens, strict=True))
    return linear, 4.0 * shape.num_layers * shape.num_heads * shape.head_dim * key_visits


def cached_tokens_read(workload: Workload) -> int:
    """Output token j of a request reads the K/V of its prompt and of its j earlier outputs."""
    pairs = zip(workload.prompts, workload.max_tokens, strict=True)
    return sum(m * len(p) + m * (m - 1) // 2 for p, m in pairs)


def min_decode_steps(workload: Workload, max_num_seqs: int | None = None) -> int:
    """A sequence gains one token per step; at most max_num_seqs of them run in one step."""
    steps = max(workload.max_tokens)
    if max_num_seqs is not None:
        steps = max(steps, -(-workload.num_output_tokens // max_num_seqs))
    return steps


@dataclass
class Roofline:
    """Floors of a workload, in seconds; the roofline is the larger of compute and memory."""

    compute_s: float  # the FLOPs at the measured matrix rate
    weight_stream_s: float  # every weight read once per decode step
    kv_read_s: float  # every output token's read of its cached K/V
    num_steps: int

    @property
    def memory_s(self) -> float:
        return self.weight_stream_s + self.kv_read_s

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s)


def roofline(flops: float, weight_bytes: int, kv_bytes_per_token: int, workload: Workload, *,
             flop_rate: float, bandwidth: float, max_num_seqs: int | None = None) -> Roofline:
    steps = min_decode_steps(workload, max_num_seqs)
    return Roofline(flops / flop_rate, steps * weight_bytes / bandwidth,
                    cached_tokens_read(workload) * kv_bytes_per_token / bandwidth, steps)


