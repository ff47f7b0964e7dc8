"""BERT encoder (`BertModel`: bge-*-en-v1.5, e5, all-MiniLM): the final hidden states, no head.

Bidirectional attention inside each input, absolute position and token type embeddings,
post-LayerNorm residual blocks, GELU. No KV cache: an input is computed whole in one forward
and nothing of it is kept. Tensor parallelism is the decoders' (workers/layers/linear.py): q/k/v
and the MLP's first projection split by output, the attention output and the MLP's second
projection by input, ending in one all-reduce each; the word embedding is vocab-parallel.

A step's inputs are packed (`[num_tokens]`, one sequence after another); attention runs on
them padded to the longest input of the step through torch's SDPA with a key mask, on any device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shared.model_config import ModelConfig
from workers.layers.embedding import VocabParallelEmbedding
from workers.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from workers.parallel import TensorParallel
from workers.pipeline import SINGLE_STAGE, PipelineStage

# Checkpoint tensors a BertModel carries that the encoder's output does not use.
_IGNORED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids", "embeddings.token_type_ids")


@dataclass
class EncoderBatch:
    """Where each packed row sits in the step padded to its longest input (built once per step)."""

    pad_index: torch.Tensor  # [num_seqs, max_len] long: the packed row at each padded slot (0 past the end)
    key_mask: torch.Tensor  # [num_seqs, 1, 1, max_len] bool: True where a key is a real token
    unpad_index: torch.Tensor  # [num_tokens] long: each packed row's slot in [num_seqs * max_len]

    @classmethod
    def of(cls, seq_lens: list[int], upload: Callable[[np.ndarray], torch.Tensor]) -> EncoderBatch:
        """Built on the host, sent up in one int64 array through `upload` (the runner's pinned
        staging ring: nothing waits for the device)."""
        lens = np.asarray(seq_lens, dtype=np.int64)
        max_len = int(lens.max())
        starts = np.cumsum(lens) - lens
        slots = np.arange(max_len, dtype=np.int64)[None, :]  # [1, max_len]
        is_real = slots < lens[:, None]  # [num_seqs, max_len]
        pad_index = np.where(is_real, starts[:, None] + slots, 0).reshape(-1)
        unpad_index = np.flatnonzero(is_real.reshape(-1))
        parts = [pad_index, unpad_index, is_real.reshape(-1).astype(np.int64)]
        d_pad, d_unpad, d_real = torch.split(upload(np.concatenate(parts)), [len(p) for p in parts])
        return cls(d_pad.view(len(lens), max_len), (d_real != 0).view(len(lens), 1, 1, max_len), d_unpad)


def _activation(name: str):
    if name == "gelu":
        return F.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    return F.relu


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_heads,
                                          True, tp)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.head_dim = cfg.head_dim

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        # x: [num_tokens, hidden] -> [num_tokens, this rank's heads * head_dim]
        size = self.num_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([size, size, size], dim=-1)
        num_seqs, max_len = batch.pad_index.shape

        def padded(t: torch.Tensor) -> torch.Tensor:  # -> [num_seqs, heads, max_len, head_dim]
            return t[batch.pad_index].view(num_seqs, max_len, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=batch.key_mask)
        out = out.transpose(1, 2).reshape(num_seqs * max_len, size)
        return out[batch.unpad_index]


class BertSelfOutput(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, in_shard: tuple[int, int]) -> None:
        super().__init__()
        self.dense = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, True, tp, in_shard=in_shard)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)  # noqa: N815 (checkpoint name)


class BertAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg, tp)
        self.output = BertSelfOutput(cfg, tp, self.self.qkv_proj.shards[0])

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        return self.output.LayerNorm(x + self.output.dense(self.self(x, batch)))  # post-LN


class BertIntermediate(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, True, tp)


class BertOutput(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.dense = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, True, tp)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)  # noqa: N815


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.attention = BertAttention(cfg, tp)
        self.intermediate = BertIntermediate(cfg, tp)
        self.output = BertOutput(cfg, tp)
        self.act = _activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        x = self.attention(x, batch)
        inner = self.act(self.intermediate.dense(x))  # [num_tokens, this rank's intermediate]
        return self.output.LayerNorm(x + self.output.dense(inner))


class BertEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, tp) for _ in range(cfg.num_layers))


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(cfg.type_vocab_size, 1), cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)  # noqa: N815

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Every input is one segment: token type 0, as sentence-transformers encodes a text.
        x = self.word_embeddings(token_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])


class BertModel(nn.Module):
    """The encoder; `forward` returns the final hidden state of every packed row."""

    is_encoder = True
    packed_modules = {
        "query": ("qkv_proj", "q"),
        "key": ("qkv_proj", "k"),
        "value": ("qkv_proj", "v"),
    }

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, max_positions: int,
                 stage: PipelineStage = SINGLE_STAGE) -> None:
        super().__init__()
        if stage.size > 1:
            raise ValueError("a BERT encoder runs in one pipeline stage")
        self.cfg = cfg
        self.embeddings = BertEmbeddings(cfg, tp)
        self.encoder = BertEncoder(cfg, tp)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        # token_ids, positions: [num_tokens] (positions from 0 in each input) -> [num_tokens, hidden]
        x = self.embeddings(token_ids, positions)
        for layer in self.encoder.layer:
            x = layer(x, batch)
        return x

    def stage_tensor_name(self, name: str) -> str | None:
        """Our parameter of a checkpoint tensor (a `bert.` prefix dropped, old LayerNorm names
        mapped); None for the tensors we do not use (the pooler, position id buffers)."""
        name = name.removeprefix("bert.")
        if name.startswith(_IGNORED_PREFIXES):
            return None
        if name.endswith(".gamma"):
            return name.removesuffix(".gamma") + ".weight"
        if name.endswith(".beta"):
            return name.removesuffix(".beta") + ".bias"
        return name
