"""A decode-only paged-attention kernel that splits each sequence's context (flash-decoding), a
candidate beside triton_attention.py's one kernel for every step. Off by default: it runs where
TOKENFLEET_DECODE_ATTENTION=split (or triton_attention.DECODE_KERNEL = "split") until it has been
measured against the default (scripts/bench_attention_gpu.py prints both).

What differs from the default kernel's decode launches, each aimed at reading K/V at the card's
copy bandwidth:

- The grid is (sequence, KV head, segment) with segments chosen so that the launch has about
  PROGRAMS_PER_SM programs per SM: at 64 rows x 8 KV heads an H100's 132 SMs get ~4 programs
  each, not ~1 doing a 16k context alone. The count depends on the batch's shape only (a CUDA
  graph replays it for any contexts); how many keys a segment takes is decided in the kernel
  from the sequence's length, at least MIN_SEGMENT_TILES tiles, so that short contexts are not
  cut into slivers: their spare programs only write an empty partial.
- The block table is read a page at a time (BLOCK_N / PAGE_SIZE entries a tile, not one per key).
- No causal mask or sequence search: a decode token sees every key of its sequence.
- Smaller tiles by default (64 keys, 3 stages): less shared memory a program, so more programs
  resident on an SM keep more loads in flight.

The partials are combined by triton_attention's combine kernel (same layout).
"""

from __future__ import annotations

import functools

import torch

from workers.layers.triton_import import tl, triton

BLOCK_N = 64  # keys a tile
NUM_WARPS = 4
NUM_STAGES = 3
PROGRAMS_PER_SM = 4  # target of a launch's programs (sequences x KV heads x segments) per SM
MAX_SEGMENTS = 16
MIN_SEGMENT_TILES = 4  # a segment takes at least this many tiles (256 keys at BLOCK_N 64)
MIN_ROWS = 16  # the smallest M of a tensor-core product: one token's query heads, padded


if triton is not None:

    @triton.jit(do_not_specialize=["stride_table_seq"],
                do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "query_start_ptr"])
    def _split_decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_ptr, scale, k_scale_ptr, v_scale_ptr,
        stride_q_tok, stride_q_head,
        stride_cache_block, stride_cache_token, stride_cache_head,
        stride_table_seq,
        stride_out_tok, stride_out_head,
        GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
        MIN_SEGMENT_TILES: tl.constexpr, IEEE_DOT: tl.constexpr, WIDEN_FP16: tl.constexpr,
        KV_SCALED: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        segment = tl.program_id(2)
        q_start = tl.load(query_start_ptr + seq)
        if tl.load(query_start_ptr + seq + 1) == q_start:  # an empty slot of a mixed-step graph
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        if KV_SCALED:
            scale = scale * tl.load(k_scale_ptr)

        rows = tl.arange(0, ROWS)
        head = kv_head * GROUP + rows
        row_ok = rows < GROUP
        d = tl.arange(0, HEAD_DIM_PAD)
        d_ok = d < HEAD_DIM
        q_row = q_start.to(tl.int64)
        q = tl.load(q_ptr + q_row * stride_q_tok + head[:, None] * stride_q_head + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [ROWS, HEAD_DIM_PAD]
        if WIDEN_FP16:
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

        # This segment's tiles: the sequence's tiles in runs of at least MIN_SEGMENT_TILES.
        num_tiles = tl.cdiv(seq_len, BLOCK_N)
        tiles_per_segment = tl.maximum(tl.cdiv(num_tiles, NUM_SEGMENTS), MIN_SEGMENT_TILES)
        tile_begin = segment * tiles_per_segment
        tile_end = tl.minimum(tile_begin + tiles_per_segment, num_tiles)

        PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE
        m = tl.full([ROWS], float("-inf"), tl.float32)
        denom = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
        page_slot = tl.arange(0, PAGES)
        in_page = tl.arange(0, PAGE_SIZE)
        n = tl.arange(0, BLOCK_N)
        head_off = kv_head * stride_cache_head
        for tile in range(tile_begin, tile_end):
            page_idx = tile * PAGES + page_slot
            pages = tl.load(table + page_idx, mask=page_idx * PAGE_SIZE < seq_len, other=0).to(tl.int64)
            key_off = tl.reshape(pages[:, None] * stride_cache_block + in_page[None, :] * stride_cache_token,
                                 (BLOCK_N,)) + head_off  # [BLOCK_N], key order
            key_ok = tile * BLOCK_N + n < seq_len
            kv_mask = key_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + key_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(v_cache_ptr + key_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            if IEEE_DOT:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(key_ok[None, :], scores * scale, float("-inf"))  # [ROWS, BLOCK_N]
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])  # every tile holds a visible key: m_new is finite
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, axis=1)
            if IEEE_DOT:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new

        if KV_SCALED:
            acc = acc * tl.load(v_scale_ptr)
        if NUM_SEGMENTS == 1:
            out = acc / denom[:, None]
            out_offs = q_row * stride_out_tok + head[:, None] * stride_out_head + d[None, :]
            out_mask = row_ok[:, None] & d_ok[None, :]
            tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            # triton_attention's partials: [num_tokens, num_heads, NUM_SEGMENTS (, HEAD_DIM_PAD)];
            # a segment past the sequence's tiles writes an empty one (max -inf, sum 0).
            part = (q_row * tl.num_programs(1) * GROUP + head) * NUM_SEGMENTS + segment
            tl.store(part_max_ptr + part, m, mask=row_ok)
            tl.store(part_sum_ptr + part, denom, mask=row_ok)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=row_ok[:, None])


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def supports(page_size: int) -> bool:
    """Whole pages per tile: a power-of-two page no larger than a tile."""
    return page_size <= BLOCK_N and page_size & (page_size - 1) == 0


def split_segments(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Segments per sequence: a power of two giving the launch ~PROGRAMS_PER_SM programs per SM."""
    if device.type != "cuda":
        return 4  # the interpreter: exercise the split path
    index = device.index if device.index is not None else torch.cuda.current_device()
    target = PROGRAMS_PER_SM * num_sms(index)
    segments = 1
    while segments < MAX_SEGMENTS and num_seqs * num_kv_heads * segments < target:
        segments *= 2
    return segments


def launch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
    num_tokens: int, num_segments: int | None, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
    widen_fp16: bool, combine,
) -> None:
    """Decode rows of the sequences given (one query token each, rows query_start_loc[s]; an
    empty slot has none) into `out`; num_tokens: the rows a split's partials cover (0..n-1);
    combine: triton_attention's partials combine, launched as (acc, max, sum, segments)."""
    _, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    head_dim_pad = triton.next_power_of_2(head_dim)
    if num_segments is None:
        num_segments = split_segments(num_seqs, num_kv_heads, q.device)
    if num_segments > 1:
        part_acc = torch.empty((num_tokens, num_heads, num_segments, head_dim_pad), dtype=torch.float32,
                               device=q.device)
        part_max = torch.empty((num_tokens, num_heads, num_segments), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # never touched
    _split_decode_kernel[(num_seqs, num_kv_heads, num_segments)](
        q, k_cache, v_cache, out, part_acc, part_max, part_sum,
        block_tables, seq_lens, query_start_loc, scale,
        k_scale if k_scale is not None else q, v_scale if v_scale is not None else q,  # (q: never read)
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, ROWS=max(MIN_ROWS, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, PAGE_SIZE=page_size, BLOCK_N=BLOCK_N, NUM_SEGMENTS=num_segments,
        MIN_SEGMENT_TILES=MIN_SEGMENT_TILES, IEEE_DOT=q.dtype == torch.float32, WIDEN_FP16=widen_fp16,
        KV_SCALED=k_scale is not None, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if num_segments > 1:
        combine(part_acc, part_max, part_sum, num_segments)
