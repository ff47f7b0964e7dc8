"""Attention over the paged KV cache, for steps that mix prefill chunks and decodes.

The cache of one layer is [2, num_blocks, block_size, num_kv_heads, head_dim]. Each step
first applies the rotary embedding to q and k and writes the new tokens' K/V into their
slots (one fused kernel on CUDA, `triton_fused.rope_and_store`), then attends. On CUDA one Triton kernel
(`triton_attention`) serves every token of the step, decodes and prefill chunks alike, each
over its own sequence's pages. Elsewhere the portable PyTorch path runs:
- decodes as one padded batch over the blocks their tables name (or per sequence on CPU),
- each prefill chunk over its cached prefix plus itself, causally.
The cache may hold FP8 (e4m3) K/V with a per-layer scale (`--kv-cache-dtype fp8`; kv_fp8.py):
every path then casts what it writes and widens what it reads, in the same kernel. The scales
are this layer's parameters in device memory (the kernels read them through a pointer), from
the checkpoint or measured in the first real step (kv_scales.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.attention_metadata import AttentionMetadata, PrefillChunk
from workers.layers import kv_scales, triton_attention, triton_fused
from workers.layers.kv_fp8 import from_cache, is_fp8, to_cache
from workers.layers.rotary import RotaryEmbedding


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        # Per-layer scales of an FP8 KV cache (stored = value / scale); unused otherwise. Scalars
        # in device memory: a CUDA graph captured before they are measured reads the measured ones.
        self.k_scale = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
        self.v_scale = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
        self.kv_scale_source = "unit"  # "checkpoint" once the weight loader filled both
        self.checkpoint_scales: set[str] = set()  # those the weight loader filled
        self.is_measuring = False  # measure in the next forward (kv_scales.prepare sets it)

    def weight_loader(self, param: nn.Parameter, tensor_slice, shard_id=None) -> None:
        """A checkpoint's k_scale or v_scale (every rank takes the whole scalar)."""
        name = "k_scale" if param is self.k_scale else "v_scale"
        kv_scales.load_scale(param, tensor_slice, name)
        self.checkpoint_scales.add(name)
        if self.checkpoint_scales == {"k_scale", "v_scale"}:
            self.kv_scale_source = "checkpoint"

    def _measure(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 rotary: RotaryEmbedding) -> None:
        """Fix the scales from this step's K (after the rotary embedding, as stored) and V."""
        _, rotated_k = rotary(positions, k, k)
        self.k_scale.data.copy_(kv_scales.measured_scale(rotated_k))
        self.v_scale.data.copy_(kv_scales.measured_scale(v))
        self.is_measuring = False
        self.kv_scale_source = "measured"

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # positions: [num_tokens]; q: [num_tokens, num_heads, head_dim] and k, v:
        # [num_tokens, num_kv_heads, head_dim], before the rotary embedding -> [num_tokens, heads * dim]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if self.is_measuring and q.shape[0]:
            self._measure(positions, k, v, rotary)
        if triton_fused.is_available(q):
            q = triton_fused.rope_and_store(q, k, v, positions, rotary.cos, rotary.sin, k_cache, v_cache,
                                            meta.slot_mapping, k_scale=self.k_scale, v_scale=self.v_scale)
        else:
            q, k = rotary(positions, q, k)
            stored_k = to_cache(k, k_cache.dtype, self.k_scale)
            stored_v = to_cache(v, v_cache.dtype, self.v_scale)
            k_cache.view(-1, self.num_kv_heads, self.head_dim)[meta.slot_mapping] = stored_k
            v_cache.view(-1, self.num_kv_heads, self.head_dim)[meta.slot_mapping] = stored_v
            if is_fp8(k_cache):  # fresh K/V as the cache holds them (kv_fp8.py says why)
                k = from_cache(stored_k, q.dtype, self.k_scale)
                v = from_cache(stored_v, q.dtype, self.v_scale)

        scales = {"k_scale": self.k_scale, "v_scale": self.v_scale} if is_fp8(k_cache) else {}
        if triton_attention.is_available(q) and meta.num_decode_slots is not None:  # a mixed-step graph
            out = triton_attention.paged_attention_slots(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale,
                num_decode_slots=meta.num_decode_slots, **scales,
            )
            return out.view(q.shape[0], self.num_heads * self.head_dim)
        if triton_attention.is_available(q):
            out = triton_attention.paged_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                meta.max_query_len, self.scale, num_decodes=meta.num_decode_tokens, **scales,
            )
            return out.view(q.shape[0], self.num_heads * self.head_dim)

        n = meta.num_decode_tokens
        # Rows that no decode or chunk owns (a graph capture's dummy rows) get zeros, not whatever
        # memory held: their K/V goes into the scratch block, which padded tables read masked.
        covered = n + sum(chunk.num_tokens for chunk in meta.prefills)
        out = torch.empty_like(q) if covered == q.shape[0] else torch.zeros_like(q)
        if n:
            out[:n] = self._attend_decodes(q[:n], k_cache, v_cache, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[rows] = self._attend_prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _keys(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gathered cache blocks -> keys in the activations' dtype (widened here from FP8)."""
        return from_cache(stored, dtype, self.k_scale)

    def _values(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return from_cache(stored, dtype, self.v_scale)

    def _attend_decodes(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # q: [num_decodes, num_heads, head_dim] -> same shape
        if meta.decode_host is not None:
            return self._attend_decodes_per_sequence(q, k_cache, v_cache, meta)
        tables = meta.decode_block_tables
        num_decodes = q.shape[0]
        # Built on the device from the lengths: no host round trip.
        key_pos = torch.arange(tables.shape[1] * meta.block_size, device=q.device)
        mask = (key_pos[None, :] < meta.decode_context_lens[:, None]).view(num_decodes, 1, 1, -1)
        # [num_decodes, max_blocks, block_size, kv_heads, head_dim] -> [n, kv_heads, L, head_dim]
        shape = (num_decodes, -1, self.num_kv_heads, self.head_dim)
        keys = self._keys(k_cache[tables], q.dtype).view(shape).transpose(1, 2)
        values = self._values(v_cache[tables], q.dtype).view(shape).transpose(1, 2)
        attn = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [num_decodes, num_heads, 1, head_dim]
        return attn.squeeze(2)

    def _attend_decodes_per_sequence(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """CPU: each sequence attends over just its own blocks (a view when they are
        consecutive), so no step copies the padded cache of the whole batch (that copy was
        a third of CPU step time)."""
        out = torch.empty_like(q)
        gqa = self.num_heads != self.num_kv_heads
        for i, (blocks, context_len) in enumerate(meta.decode_host):
            keys, values = self._keys(k_cache[blocks], q.dtype), self._values(v_cache[blocks], q.dtype)
            # [blocks, block_size, kv_heads, head_dim] -> [1, kv_heads, context_len, head_dim]
            keys = keys.reshape(-1, self.num_kv_heads, self.head_dim)[:context_len].transpose(0, 1)
            values = values.reshape(-1, self.num_kv_heads, self.head_dim)[:context_len].transpose(0, 1)
            out[i] = F.scaled_dot_product_attention(
                q[i].unsqueeze(1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), scale=self.scale,
                enable_gqa=gqa,
            )[0, :, 0]
        return out

    def _attend_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunk: PrefillChunk,
    ) -> torch.Tensor:
        # q: [chunk_len, num_heads, head_dim]
        gqa = self.num_heads != self.num_kv_heads
        if chunk.start_pos == 0:
            # Nothing cached before this chunk: attend over the fresh K/V, plain causal.
            # 4-D inputs: PyTorch takes its fused kernel (3-D ones fall back to the slow path).
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=self.scale, enable_gqa=gqa,
            )
            return attn[0].transpose(0, 1)
        context_len = chunk.start_pos + chunk.num_tokens
        shape = (-1, self.num_kv_heads, self.head_dim)
        keys = self._keys(k_cache[chunk.block_table], q.dtype).view(shape)[:context_len]
        values = self._values(v_cache[chunk.block_table], q.dtype).view(shape)[:context_len]
        # Query i sits at position start_pos + i and sees keys 0..start_pos + i.
        query_pos = torch.arange(chunk.num_tokens, device=q.device) + chunk.start_pos
        key_pos = torch.arange(context_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [chunk_len, context_len]
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=self.scale, enable_gqa=gqa,
        )
        return attn[0].transpose(0, 1)
