"""How many sequences a step may run, and up to which batch CUDA graphs are captured, chosen from
the card's memory and the model instead of one constant.

The rule (pure arithmetic, so that it can be checked without a GPU; workers/card_sizing.py reads
the card and the checkpoint and applies it):

    max_num_seqs = min(card tier's cap, sequences the KV pool holds at TYPICAL_CONTEXT tokens)
    cuda_graph_max_batch_size = min(max_num_seqs, card tier's graph cap)

Card tiers (total memory the driver reports, GiB -> sequences, largest graph):

    >= 64 GiB (H100/A100 80 GB report ~79 GiB, H200 ~140)  -> 1024, 512
    >= 32 GiB (A100 40 GB ~39.4, L40S/A6000 ~44-48)        ->  512, 256
    smaller (24 GB cards ~23.6)                            ->  256, 128

The figures that chose them:

- vLLM's defaults have the same three tiers (1024 sequences and graphs up to 512 from 70 GiB,
  512 and 256 from 40 GiB, 256 and 128 below); our lowest boundaries sit a little under theirs
  (64 and 32 GiB) so that a card sold as 80 or 40 GB, which reports somewhat less, lands where
  its label says.
- On one H100 80 GB, Llama-3-8B shape in bf16, a burst of 2,000 ShareGPT-like requests ran 536 of
  its 1,065 steps at 512 sequences with more waiting: 512 bound half the run. At 512 against 256
  on an H200, 500 requests went from 8.5k to 10.2k output tok/s (docs/perf-notes.md): decode
  reads the weights once per step, so more rows per step keep paying while the K/V fits.
- The KV bound: TYPICAL_CONTEXT = 320 tokens is what a running ShareGPT-like sequence holds on
  average: its prompt (~200 tokens) and, over its life, half its output (~180 / 2), rounded up
  to whole 16-token blocks. Llama-3-8B in bf16 keeps 128 KiB of K/V per token; on an 80 GB card,
  after 16 GB of weights, the runner's activation reserve (~10.7 GB for 8,192-token steps and
  2,048-token mixed graphs) and the 0.9 memory fraction, its pool is ~48 GiB: ~1,200 such
  sequences, so the tier's 1024 stands. On an A100 40 GB the same model's pool (~12 GiB) holds
  ~300: 304 sequences, not the tier's 512, which would only wait for blocks (or be preempted)
  while their graphs cost capture time. The bound is rounded down to a multiple of 8 (the graph
  sizes' step), never under MIN_NUM_SEQS (a model that leaves no pool fails to load anyway, with
  its own error).
- Graphs: sizes 1, 2, 4 and every multiple of 8 are captured (workers/cuda_graphs.py), so a
  largest graph of 1024 means 131 captures against 67 at 512, each a warm-up and a capture of the
  whole forward; their memory is one shared pool, as large as the largest graph's activations.
  What a graph saves is the host's launch time (~2-3 ms a step for 32 layers), which a step of
  512 rows (~10-16 ms of GPU time, async scheduling overlapping the next launch) already hides;
  steps above the largest graph run eagerly.

An explicit --max-num-seqs (or --cuda-graph-max-batch-size) always wins over the rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.model_config import ModelConfig

if TYPE_CHECKING:
    from shared.config import EngineConfig

GIB = 1 << 30
TYPICAL_CONTEXT = 320  # tokens a typical running sequence holds (prompt + output so far)
MIN_NUM_SEQS = 8


@dataclass(frozen=True)
class CardTier:
    min_gib: float  # the card's total memory, at least
    max_num_seqs: int
    max_graph_batch: int


# Largest first; the last tier takes every smaller card.
CARD_TIERS = (
    CardTier(64, 1024, 512),
    CardTier(32, 512, 256),
    CardTier(0, 256, 128),
)


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # workers/device.py's DTYPES


@dataclass(frozen=True)
class BatchSizing:
    max_num_seqs: int
    max_graph_batch: int  # the card tier's largest graph, whatever max_num_seqs ends up
    reason: str  # what chose them, for the engine's log

    def graph_batch_for(self, max_num_seqs: int) -> int:
        """The largest captured decode batch under `max_num_seqs` (the rule's or a user's)."""
        return min(max_num_seqs, self.max_graph_batch)


def card_tier(card_bytes: int) -> CardTier:
    return next(tier for tier in CARD_TIERS if card_bytes >= tier.min_gib * GIB)


def weight_bytes_estimate(cfg: ModelConfig, *, dtype_bytes: int, linear_bytes: float | None = None,
                          num_ranks: int = 1) -> int:
    """One rank's share of the weights, from the shapes alone: linear layers at `linear_bytes` a
    parameter (1 under fp8/int8; None: dtype_bytes), embeddings and norms at dtype_bytes."""
    linear_bytes = dtype_bytes if linear_bytes is None else linear_bytes
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hidden = cfg.hidden_size
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * cfg.intermediate_size
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
    total = cfg.num_layers * per_layer * linear_bytes + (embeddings + norms) * dtype_bytes
    return int(total // num_ranks)


def kv_bytes_per_token(cfg: ModelConfig, *, kv_dtype_bytes: int, tp: int = 1, pp: int = 1) -> int:
    """K and V of one token on one rank: its stage's layers, its share of the KV heads."""
    layers = -(-cfg.num_layers // pp)
    kv_heads = -(-cfg.num_kv_heads // tp)
    return 2 * layers * kv_heads * cfg.head_dim * kv_dtype_bytes


def choose_batch_sizing(*, card_bytes: int, weight_bytes: int, kv_bytes_per_token: int,
                        activation_bytes: int, memory_fraction: float,
                        typical_context: int = TYPICAL_CONTEXT, pool_bytes: int | None = None) -> BatchSizing:
    """max_num_seqs and the largest graph batch for one rank of `card_bytes` holding
    `weight_bytes` of weights (see the module docstring for the rule and its figures);
    `pool_bytes`: the KV pool a user fixed (--num-kv-blocks), instead of the runner's estimate."""
    if card_bytes <= 0 or kv_bytes_per_token <= 0 or typical_context <= 0:
        raise ValueError("card_bytes, kv_bytes_per_token and typical_context must be positive")
    tier = card_tier(card_bytes)
    # As the runner sizes the pool (workers/runner_build.py): the fraction of what the weights
    # leave, less the largest step's activations.
    pool = (pool_bytes if pool_bytes is not None
            else int((card_bytes - weight_bytes) * memory_fraction) - activation_bytes)
    fits = max(0, pool) // (kv_bytes_per_token * typical_context)
    by_kv = max(MIN_NUM_SEQS, fits // 8 * 8)
    max_num_seqs = min(tier.max_num_seqs, by_kv)
    bound = "the card's tier" if max_num_seqs == tier.max_num_seqs else "the KV pool"
    reason = (f"{card_bytes / GIB:.1f} GiB card: tier cap {tier.max_num_seqs} sequences, graphs up to "
              f"{tier.max_graph_batch}; KV pool ~{max(0, pool) / GIB:.1f} GiB after "
              f"{weight_bytes / GIB:.1f} GiB of weights holds {fits} sequences of {typical_context} tokens "
              f"({kv_bytes_per_token} B/token): {max_num_seqs}, bound by {bound}")
    return BatchSizing(max_num_seqs, tier.max_graph_batch, reason)


def activation_reserve_bytes(hidden_size: int, max_num_batched_tokens: int,
                             mixed_graph_tokens: int = 0) -> int:
    """What the runner keeps out of the KV pool for activations: room for the largest step's, and
    as much again for the mixed graphs' private pool (their largest bucket's activations)."""
    return 64 * (max_num_batched_tokens + mixed_graph_tokens) * hidden_size * 4


def sizing_for(config: EngineConfig, model: ModelConfig, card_bytes: int) -> BatchSizing:
    """The rule for `config`'s model on a card of `card_bytes`, each rank holding its share of the
    weights and of the K/V (tp x pp ranks, one card each)."""
    dtype_bytes = DTYPE_BYTES.get(config.dtype or "bfloat16", 2)
    quantized = config.quantization or model.checkpoint_quantization
    kv_dtype_bytes = 1 if config.kv_cache_dtype == "fp8" else dtype_bytes
    step_tokens = config.max_num_batched_tokens
    mixed_tokens = min(config.cuda_graph_max_tokens, step_tokens) if config.cuda_graphs else 0
    tp, pp = config.tp, config.pp
    per_token = kv_bytes_per_token(model, kv_dtype_bytes=kv_dtype_bytes, tp=tp, pp=pp)
    return choose_batch_sizing(
        card_bytes=card_bytes,
        weight_bytes=weight_bytes_estimate(model, dtype_bytes=dtype_bytes,
                                           linear_bytes=1 if quantized else None, num_ranks=tp * pp),
        kv_bytes_per_token=per_token,
        activation_bytes=activation_reserve_bytes(model.hidden_size, step_tokens, mixed_tokens),
        memory_fraction=config.kv_cache_memory_fraction,
        pool_bytes=(config.num_kv_blocks * config.block_size * per_token
                    if config.num_kv_blocks is not None else None),
    )
