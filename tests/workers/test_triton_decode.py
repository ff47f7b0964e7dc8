"""The fused Triton decode kernel against the portable PyTorch path (CUDA only)."""

from __future__ import annotations

import pytest
import torch

from workers.attention_metadata import AttentionMetadata
from workers.layers import triton_decode
from workers.layers.attention import PagedAttention

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or triton_decode.triton is None, reason="needs CUDA and Triton"
)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (32, 8, 128), (4, 4, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_matches_pytorch_path(num_heads, num_kv_heads, head_dim, dtype) -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    block_size, num_blocks, num_seqs = 16, 64, 5
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(num_seqs, num_heads, head_dim, device=device, dtype=dtype)
    lens = torch.tensor([1, 16, 17, 100, 190], dtype=torch.int32, device=device)
    tables = torch.randperm(num_blocks, device=device)[: num_seqs * 12].view(num_seqs, 12)
    out = triton_decode.paged_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    key_pos = torch.arange(12 * block_size, device=device)
    meta = AttentionMetadata(None, num_seqs, tables, lens,
                             (key_pos[None] < lens[:, None]).view(num_seqs, 1, 1, -1), [], block_size)
    ref = PagedAttention(num_heads, num_kv_heads, head_dim)._attend_decodes(
        q.float(), k_cache.float(), v_cache.float(), meta)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (out.float() - ref).abs().max() < tol
