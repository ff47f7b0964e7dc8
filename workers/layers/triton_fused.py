"""Fused per-token kernels for CUDA (Triton): one launch where PyTorch runs 5-15.

Each op here runs ~10-15 tiny elementwise kernels per layer in PyTorch (float32 upcasts,
products, casts, index_put). A decode step launches ~1,500 kernels that way, which at batch 1
costs more than reading the weights, and in prefill-heavy steps each of them streams the whole
[tokens, hidden] activation through memory. These kernels keep PyTorch's rounding points (every
bf16 product or sum rounded as PyTorch would round it), so greedy tokens do not move:
- rms_norm: (x + residual) rounded, RMSNorm in float32, cast, times the weight (HF's order);
- rope_and_store: rotary embedding of q and k, and k, v written into their cache slots (an FP8
  cache gets them divided by the layer's scale and cast to e4m3 in the same store, kv_fp8.py);
- silu_and_mul: silu(gate) rounded, times up.
The CPU path keeps the PyTorch code in norm.py, rotary.py and llama.py.
"""

from __future__ import annotations

import torch

from workers.layers.triton_import import is_available, tl, triton  # noqa: F401 - is_available is this module's API too

if triton is not None:

    @triton.jit
    def rms_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, cols, mask, stride_x, stride_res, eps,
                     N: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        """One row of weight * rms_norm(x [+ residual]) in float32, each step rounded to x's dtype
        as PyTorch rounds it; x + residual stored at res_out_ptr when HAS_RESIDUAL. (The RMSNorm
        kernel below and the FP8 one of triton_quant.py, which quantizes the row instead.)"""
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        dtype = x.dtype
        x = x.to(tl.float32)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
            x = (x + res).to(dtype)  # the sum PyTorch would store, rounded
            tl.store(res_out_ptr + row * N + cols, x, mask=mask)
            x = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        normed = (x * rstd).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        return w * normed

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, eps,
                         N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        y = rms_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, cols, mask, stride_x, stride_res, eps, N,
                         HAS_RESIDUAL)
        tl.store(out_ptr + row * N + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate(x1, x2, cos, sin):
        """(x1, x2) halves of a head -> the rotated halves, each product and sum rounded to x's
        dtype as `x * cos + rotate_half(x) * sin` rounds them (rotate_half(x) = [-x2, x1])."""
        dtype = x1.dtype
        a1 = x1.to(tl.float32)
        a2 = x2.to(tl.float32)
        out1 = ((a1 * cos).to(dtype).to(tl.float32) + (-a2 * sin).to(dtype).to(tl.float32)).to(dtype)
        out2 = ((a2 * cos).to(dtype).to(tl.float32) + (a1 * sin).to(dtype).to(tl.float32)).to(dtype)
        return out1, out2

    @triton.jit
    def _to_fp8(x, inv_scale, fp8_type: tl.constexpr):
        """K or V -> e4m3 as kv_fp8.to_cache makes it: scaled in float32, saturated at +-448."""
        return tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0).to(fp8_type)

    # positions and slots are views into the step's uploaded buffer: their alignment varies,
    # and each variant would be another compile mid-serving.
    @triton.jit(do_not_specialize_on_alignment=["positions_ptr", "slots_ptr"])
    def _rope_and_store_kernel(
        q_ptr, k_ptr, v_ptr, positions_ptr, cos_ptr, sin_ptr, slots_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
        stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
        stride_table, stride_slot, k_scale_ptr, v_scale_ptr,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
        KV_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, FP8_CACHE: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        pos = tl.load(positions_ptr + tok).to(tl.int64)
        slot = tl.load(slots_ptr + tok).to(tl.int64)
        c = tl.arange(0, HALF_PAD)
        c_ok = c < HALF
        # The table is float32 (as HF builds it); HF casts it to the activations' dtype first.
        dtype = q_ptr.dtype.element_ty
        cos = tl.load(cos_ptr + pos * stride_table + c, mask=c_ok, other=0.0).to(dtype).to(tl.float32)
        sin = tl.load(sin_ptr + pos * stride_table + c, mask=c_ok, other=0.0).to(dtype).to(tl.float32)

        h = tl.arange(0, HEADS_PAD)
        mask = (h < NUM_HEADS)[:, None] & c_ok[None, :]
        offs = tok * stride_q_tok + h[:, None] * stride_q_head + c[None, :]
        q1, q2 = _rotate(tl.load(q_ptr + offs, mask=mask), tl.load(q_ptr + offs + HALF, mask=mask),
                         cos[None, :], sin[None, :])
        out_offs = tok * NUM_HEADS * 2 * HALF + h[:, None] * 2 * HALF + c[None, :]
        tl.store(q_out_ptr + out_offs, q1, mask=mask)
        tl.store(q_out_ptr + out_offs + HALF, q2, mask=mask)

        g = tl.arange(0, KV_HEADS_PAD)
        mask = (g < NUM_KV_HEADS)[:, None] & c_ok[None, :]
        offs = tok * stride_k_tok + g[:, None] * stride_k_head + c[None, :]
        k1, k2 = _rotate(tl.load(k_ptr + offs, mask=mask), tl.load(k_ptr + offs + HALF, mask=mask),
                         cos[None, :], sin[None, :])
        cache_offs = slot * stride_slot + g[:, None] * 2 * HALF + c[None, :]
        offs = tok * stride_v_tok + g[:, None] * stride_v_head + c[None, :]
        v1 = tl.load(v_ptr + offs, mask=mask)
        v2 = tl.load(v_ptr + offs + HALF, mask=mask)
        if FP8_CACHE:  # the layer's scales, from device memory (a graph replays their current value)
            inv_k_scale = 1.0 / tl.load(k_scale_ptr)
            inv_v_scale = 1.0 / tl.load(v_scale_ptr)
            k1 = _to_fp8(k1, inv_k_scale, k_cache_ptr.dtype.element_ty)
            k2 = _to_fp8(k2, inv_k_scale, k_cache_ptr.dtype.element_ty)
            v1 = _to_fp8(v1, inv_v_scale, v_cache_ptr.dtype.element_ty)
            v2 = _to_fp8(v2, inv_v_scale, v_cache_ptr.dtype.element_ty)
        tl.store(k_cache_ptr + cache_offs, k1, mask=mask)
        tl.store(k_cache_ptr + cache_offs + HALF, k2, mask=mask)
        tl.store(v_cache_ptr + cache_offs, v1, mask=mask)
        tl.store(v_cache_ptr + cache_offs + HALF, v2, mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, N: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + row * N + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [num_tokens, hidden] -> norm(x [+ residual]) [, x + residual]"""
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            x, residual if residual is not None else x, weight, out, res_out, x.stride(0),
            (residual if residual is not None else x).stride(0), eps,
            N=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=min(16, max(1, block // 256)),
        )
    return out if residual is None else (out, res_out)


def rope_and_store(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim], k, v: [num_tokens, kv_heads, head_dim] (views, last dim
    contiguous); cos, sin: [max_positions, head_dim] float32; caches: [blocks, block_size,
    kv_heads, head_dim], in q's dtype or e4m3 (then stored = value / scale, the scales float32
    scalar tensors on q's device; None: 1.0). Writes rotated k and v at their slots; returns
    rotated q, contiguous."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    # The kernel addresses a slot as slot * stride(1) and a head as head * head_dim.
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == k.stride(2) == 1
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    fp8_cache = k_cache.dtype == torch.float8_e4m3fn
    if fp8_cache and (k_scale is None or v_scale is None):
        unit = torch.ones((), dtype=torch.float32, device=q.device)
        k_scale = k_scale if k_scale is not None else unit
        v_scale = v_scale if v_scale is not None else unit
    if num_tokens:
        half = head_dim // 2
        _rope_and_store_kernel[(num_tokens,)](
            q, k, v, positions, cos, sin, slot_mapping, q_out, k_cache, v_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), k_cache.stride(1), k_scale if fp8_cache else q, v_scale if fp8_cache else q,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
            KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), HALF=half,
            HALF_PAD=triton.next_power_of_2(half), FP8_CACHE=fp8_cache,
            num_warps=4,
        )
    return q_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * inter] (gate then up) -> silu(gate) * up: [num_tokens, inter]"""
    num_tokens, width = x.shape
    inter = width // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens:
        block = 1024
        grid = (num_tokens, triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](x, out, x.stride(0), N=inter, BLOCK=block, num_warps=4)
    return out
