"""Fused paged-attention decode on CUDA (Triton): reads K/V straight from the blocks a
sequence's table names, with no gather copy, online softmax in float32.

One program per (sequence, KV head) handles that head's whole query group, so grouped-
query attention loads each K/V block once for all the query heads that share it.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch path is used instead
    triton = None


def is_available(q: torch.Tensor) -> bool:
    return triton is not None and q.is_cuda


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, context_lens_ptr, scale,
        stride_q_seq, stride_q_head,
        stride_cache_block, stride_cache_token, stride_cache_head,
        stride_table_seq,
        stride_out_seq, stride_out_head,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        context_len = tl.load(context_lens_ptr + seq)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, BLOCK_SIZE)
        g_mask = g < GROUP
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
                    mask=g_mask[:, None], other=0.0).to(tl.float32)  # [GROUP_PAD, HEAD_DIM]
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
        for j in range(0, num_blocks):
            block = tl.load(block_tables_ptr + seq * stride_table_seq + j).to(tl.int64)
            t_mask = j * BLOCK_SIZE + t < context_len
            offs = block * stride_cache_block + t[:, None] * stride_cache_token \
                + kv_head * stride_cache_head + d[None, :]
            k = tl.load(k_cache_ptr + offs, mask=t_mask[:, None], other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK]
            scores = tl.where(t_mask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + offs, mask=t_mask[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = acc / denom[:, None]
        tl.store(out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim];
    block_tables: [num_seqs, max_blocks]; context_lens: [num_seqs] -> [num_seqs, num_heads, head_dim]"""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, context_lens, scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
    )
    return out
