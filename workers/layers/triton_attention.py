"""Paged attention on CUDA (Triton), one kernel for every step: decodes and prefill chunks alike.

Every query token attends over its own sequence's keys in the paged KV cache, causally by
position (the step's own K/V are already written there). Tokens are laid out sequence after
sequence; sequence s owns rows query_start_loc[s] .. query_start_loc[s+1] and its last query
token sits at position seq_lens[s] - 1.

A program takes BLOCK_Q query tokens of one sequence times the query heads of one KV head
(grouped-query attention), so its M dimension is BLOCK_Q * GROUP_PAD rows and each K/V tile
is read once for all of them. Keys come in tiles of BLOCK_N, gathered through the block
table (a tile spans several pages), both products on the tensor cores, online softmax in
float32. Decode-only batches have too few programs to fill the GPU at small batch sizes, so
they can split each sequence's keys over NUM_SEGMENTS programs and combine the partial
results in a second small kernel (split-K).

An FP8 (e4m3) cache is read as it is: each K/V tile is widened to q's dtype in registers, the
layer's K scale folds into the softmax scale and its V scale into the output (kv_fp8.py). The
scales are read from device memory (float32 scalars, one load per program), so a captured CUDA
graph replays with whatever value they hold: measured after the capture (kv_scales.py).
"""

from __future__ import annotations

import os

import torch

from workers.layers import triton_decode_attention
from workers.layers.triton_import import is_available, tl, triton  # noqa: F401 - is_available is this module's API too

# Keys per inner iteration (pages of 16: 8 or 4 pages). Measured on an H200 (profile_gpu.py
# --kernels): 128 reads K/V fastest in decode batches, 64 is faster in mixed steps.
DECODE_BLOCK_N = 128
MIXED_BLOCK_N = 64
MIXED_BLOCK_M = 64  # query rows (tokens x heads of a group) per program in steps with prefills
DECODE_BLOCK_M = 16  # the smallest M of a tensor-core product: one decode token's group, padded
# float32 (IEEE) products run on the CUDA cores, and at 64 rows a program's tiles overflow its
# registers: a 5-token verify step of SmolLM2 spent 20 ms in attention (H100), a decode 1 ms.
# Steps with prefills take the decode's 16 rows in float32.
MIXED_BLOCK_M_FP32 = 16
MAX_SEGMENTS = 16
NUM_WARPS = 4
MIXED_NUM_WARPS = 4
SPLIT_MIXED = True  # mixed steps: decodes and prefill chunks as two launches
NUM_STAGES = 2  # software pipelining of the K/V tile loads
# An FP8 cache's tiles widened to float16 (e4m3 -> f16 is one conversion per pair on Hopper; to
# bf16 it is not), q cast to float16 for the products. On the H200 (profile_gpu.py --kernels, 64
# decodes of 8.2-8.7k tokens, one layer): 490 us against 602 widened to bf16; bf16 K/V 607 us.
FP8_WIDEN_FP16 = True
# Decode launches over an FP8 cache split each sequence's keys at least this many ways, the
# decode slots of mixed-step graphs too: its tiles cost half the bytes, so one program per
# (sequence, KV head) keeps too few loads in flight. H200, CUDA-graph replays, one layer: 64
# decodes of 16-1,500 tokens 64 us against 80 unsplit (bf16 73); 64 of 8.2-8.7k tokens 417
# against 489 (bf16 600). A bf16 cache gains nothing at short contexts, so it keeps occupancy's.
FP8_MIN_DECODE_SEGMENTS = 2
# Decode launches: "paged" (this module's kernel) or "split" (triton_decode_attention.py, splitting
# each sequence's context; a candidate until measured against paged on the GPU).
DECODE_KERNELS = ("paged", "split")
DECODE_KERNEL = os.environ.get("TOKENFLEET_DECODE_ATTENTION", "paged")
if DECODE_KERNEL not in DECODE_KERNELS:
    raise ValueError(f"TOKENFLEET_DECODE_ATTENTION={DECODE_KERNEL!r} is not a decode kernel: "
                     f"choose one of {', '.join(DECODE_KERNELS)}")


if triton is not None:

    @triton.jit
    def _find_sequence(query_start_ptr, q_base, num_seqs, pid, BLOCK_Q: tl.constexpr, SEARCH: tl.constexpr):
        """The sequence whose query blocks include program `pid`: sequence s owns programs
        (query_start[s] - q_base) // BLOCK_Q + s onwards (an upper bound that needs no prefix sum of
        per-sequence block counts), which increases with s; so s is the number of sequences
        starting at or before pid, less one. Counted SEARCH sequences per vector load: a
        binary search would be ~8 dependent loads per program."""
        count = 0
        for base in range(0, num_seqs, SEARCH):
            s = base + tl.arange(0, SEARCH)
            first = (tl.load(query_start_ptr + s, mask=s < num_seqs, other=1 << 40) - q_base) // BLOCK_Q + s
            count += tl.sum((first <= pid).to(tl.int32), axis=0)
        return count - 1

    # Triton compiles a variant per 16-byte alignment of each pointer and per divisibility of
    # each integer. These arguments differ from step to step (views into the step's one
    # uploaded buffer, table widths, sequence counts): left specialised, a new variant would
    # compile (~1 s) in the middle of serving.
    @triton.jit(do_not_specialize=["num_seqs", "stride_table_seq"],
                do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "query_start_ptr"])
    def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_ptr, num_seqs, scale, k_scale_ptr, v_scale_ptr,
        stride_q_tok, stride_q_head,
        stride_cache_block, stride_cache_token, stride_cache_head,
        stride_table_seq,
        stride_out_tok, stride_out_head,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_SEGMENTS: tl.constexpr, DECODE_ONLY: tl.constexpr, IEEE_DOT: tl.constexpr,
        WIDEN_FP16: tl.constexpr, KV_SCALED: tl.constexpr,
    ):
        pid = tl.program_id(0)
        kv_head = tl.program_id(1)
        segment = tl.program_id(2)
        if DECODE_ONLY:  # one query token per sequence: program = sequence
            seq = pid
            q_block = 0
        else:
            # The launch may cover a tail of the step's sequences: rows count from its first.
            q_base = tl.load(query_start_ptr)
            seq = _find_sequence(query_start_ptr, q_base, num_seqs, pid, BLOCK_Q, 128)
            q_block = pid - ((tl.load(query_start_ptr + seq) - q_base) // BLOCK_Q + seq)
        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        if q_block * BLOCK_Q >= q_len:  # a spare program of the upper-bound grid
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        first_pos = seq_len - q_len  # position of the sequence's first query token
        if KV_SCALED:  # an FP8 cache: its K scale folds into the softmax scale
            scale = scale * tl.load(k_scale_ptr)

        BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
        rows = tl.arange(0, BLOCK_M)
        q_tok = q_block * BLOCK_Q + rows // GROUP_PAD  # within the sequence
        head = kv_head * GROUP + rows % GROUP_PAD
        row_ok = (q_tok < q_len) & (rows % GROUP_PAD < GROUP)
        d = tl.arange(0, HEAD_DIM_PAD)
        d_ok = d < HEAD_DIM
        q_rows = (q_start + q_tok).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
        if WIDEN_FP16:  # an FP8 cache's products in float16 (q clamped into its range)
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        q_pos = first_pos + q_tok

        # Keys this block of queries can see: up to its last token's position.
        last_tok = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
        kv_len = first_pos + last_tok + 1
        num_tiles = tl.cdiv(kv_len, BLOCK_N)
        tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
        tile_begin = segment * tiles_per_segment
        tile_end = tl.minimum(tile_begin + tiles_per_segment, num_tiles)

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
        n = tl.arange(0, BLOCK_N)
        for tile in range(tile_begin, tile_end):
            key_pos = tile * BLOCK_N + n
            key_ok = key_pos < kv_len
            page = tl.load(table + key_pos // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
            key_off = page * stride_cache_block + (key_pos % PAGE_SIZE) * stride_cache_token \
                + kv_head * stride_cache_head  # [BLOCK_N]
            kv_mask = key_ok[:, None] & d_ok[None, :]
            # Widened to q's dtype in registers (a no-op unless the cache is FP8).
            k = tl.load(k_cache_ptr + key_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(v_cache_ptr + key_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            if IEEE_DOT:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = scores * scale  # [BLOCK_M, BLOCK_N]
            visible = key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            # A row that sees no key of this tile (causal, or a padding row) keeps m = -inf;
            # subtracting 0 instead keeps its exponentials at 0 rather than NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            denom = denom * alpha + tl.sum(p, axis=1)
            if IEEE_DOT:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new

        if KV_SCALED:
            acc = acc * tl.load(v_scale_ptr)  # an FP8 cache's V scale
        if NUM_SEGMENTS == 1:
            out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
            out_offs = q_rows[:, None] * stride_out_tok + head[:, None] * stride_out_head + d[None, :]
            out_mask = row_ok[:, None] & d_ok[None, :]
            tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            # Partials [num_tokens, num_heads, NUM_SEGMENTS (, HEAD_DIM_PAD)], unnormalised.
            part = (q_rows * tl.num_programs(1) * GROUP + head) * NUM_SEGMENTS + segment
            tl.store(part_max_ptr + part, m, mask=row_ok)
            tl.store(part_sum_ptr + part, denom, mask=row_ok)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=row_ok[:, None])

    @triton.jit
    def _combine_segments_kernel(
        part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, stride_out_tok, stride_out_head,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    ):
        tok = tl.program_id(0)
        head = tl.program_id(1)
        base = (tok.to(tl.int64) * tl.num_programs(1) + head) * NUM_SEGMENTS
        s = tl.arange(0, NUM_SEGMENTS)
        d = tl.arange(0, HEAD_DIM_PAD)
        seg_max = tl.load(part_max_ptr + base + s)
        seg_sum = tl.load(part_sum_ptr + base + s)
        total_max = tl.max(seg_max, axis=0)
        weight = tl.exp(seg_max - total_max)  # segments that saw no key: exp(-inf) = 0
        acc = tl.load(part_acc_ptr + (base + s)[:, None] * HEAD_DIM_PAD + d[None, :])
        out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(seg_sum * weight, axis=0)
        out_offs = tok * stride_out_tok + head * stride_out_head + d
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def decode_segments(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """How many programs share one decode sequence's keys: enough for ~2 programs per SM."""
    if device.type != "cuda":
        return 4  # the interpreter: exercise the split path
    index = device.index if device.index is not None else torch.cuda.current_device()
    target = 2 * triton_decode_attention.num_sms(index)
    segments = 1
    while segments < MAX_SEGMENTS and num_seqs * num_kv_heads * segments * 2 <= target:
        segments *= 2
    return segments


def _least_segments(k_cache: torch.Tensor) -> int:
    return FP8_MIN_DECODE_SEGMENTS if k_cache.dtype == torch.float8_e4m3fn else 1


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
    num_decodes: int = 0, num_segments: int | None = None, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; caches: [num_blocks, page_size, kv_heads, head_dim];
    block_tables: [num_seqs, width]; seq_lens: [num_seqs] (cached + this step's tokens);
    query_start_loc: [num_seqs + 1]; max_query_len: the longest sequence's query count (1 means
    decode-only; known on the host); num_decodes: the first sequences, one query token each;
    num_segments: split-K of decode-only launches (None: by occupancy); k_scale, v_scale: an
    FP8 cache's per-layer scales, float32 scalar tensors on q's device (None: unscaled)
    -> [num_tokens, num_heads, head_dim]"""
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    if max_query_len == 1:
        _launch(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, scale, decode_only=True,
                num_tokens=q.shape[0], num_segments=num_segments, **scales)
        return out
    if SPLIT_MIXED and num_decodes:
        # The decodes as their own decode-only launch (one program per sequence, wider key
        # tiles), the prefill chunks in a second one; both write their rows of `out`.
        _launch(q, k_cache, v_cache, out, block_tables[:num_decodes], seq_lens[:num_decodes],
                query_start_loc[: num_decodes + 1], scale, decode_only=True, num_tokens=num_decodes,
                num_segments=num_segments, **scales)
        _launch(q, k_cache, v_cache, out, block_tables[num_decodes:], seq_lens[num_decodes:],
                query_start_loc[num_decodes:], scale, decode_only=False, num_tokens=q.shape[0] - num_decodes,
                **scales)
        return out
    _launch(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, scale, decode_only=False,
            num_tokens=q.shape[0], **scales)
    return out


def paged_attention_slots(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *, num_decode_slots: int,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A mixed step laid out in fixed sequence slots, so that its two launches' grids depend on
    the tensors' shapes alone (a CUDA graph replays them for any step that fits): slots
    0..num_decode_slots-1 hold decodes, the rest prefill chunks, and an empty slot (no query
    rows: its query_start_loc repeats) exits at once. Query rows past the last slot's end are
    padding that no program reads or writes.
    q: [num_token_slots, num_heads, head_dim]; block_tables: [num_slots, width];
    seq_lens: [num_slots]; query_start_loc: [num_slots + 1] -> [num_token_slots, num_heads, head_dim]"""
    out = torch.empty_like(q)
    d = num_decode_slots
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    # A decode's row is its slot's index and below the step's token count, so the decode launch
    # covers min(d, rows) rows: a split's partials and its combine are sized by that. With d
    # rows (max_num_seqs slots, a 16-token bucket) the combine wrote past `out`.
    _launch(q, k_cache, v_cache, out, block_tables[:d], seq_lens[:d], query_start_loc[: d + 1], scale,
            decode_only=True, num_tokens=min(d, q.shape[0]), num_segments=_least_segments(k_cache), **scales)
    # The grid's upper bound (num_tokens // BLOCK_Q + slots) holds for any split of the rows.
    _launch(q, k_cache, v_cache, out, block_tables[d:], seq_lens[d:], query_start_loc[d:], scale,
            decode_only=False, num_tokens=q.shape[0], **scales)
    return out


def _launch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
    decode_only: bool, num_tokens: int, num_segments: int | None = None, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """One launch over the sequences given (num_tokens query rows from query_start_loc[0] on)."""
    _, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = triton.next_power_of_2(head_dim)
    mixed_block_m = MIXED_BLOCK_M_FP32 if q.dtype == torch.float32 else MIXED_BLOCK_M
    block_q = max(1, (DECODE_BLOCK_M if decode_only else mixed_block_m) // group_pad)
    widen_fp16 = FP8_WIDEN_FP16 and k_cache.dtype == torch.float8_e4m3fn and q.dtype != torch.float32

    def combine(part_acc: torch.Tensor, part_max: torch.Tensor, part_sum: torch.Tensor,
                segments: int) -> None:
        _combine_segments_kernel[(num_tokens, num_heads)](
            part_acc, part_max, part_sum, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SEGMENTS=segments,
        )

    if decode_only and DECODE_KERNEL == "split" and triton_decode_attention.supports(page_size):
        triton_decode_attention.launch(
            q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, scale,
            num_tokens=num_tokens, num_segments=num_segments, k_scale=k_scale, v_scale=v_scale,
            widen_fp16=widen_fp16, combine=combine)
        return
    if not decode_only:
        num_segments = 1
    elif num_segments is None:
        num_segments = max(decode_segments(num_seqs, num_kv_heads, q.device), _least_segments(k_cache))
    num_programs = num_seqs if decode_only else num_tokens // block_q + num_seqs
    if num_segments > 1:  # decode-only: rows 0..num_tokens-1
        part_acc = torch.empty((num_tokens, num_heads, num_segments, head_dim_pad), dtype=torch.float32,
                               device=q.device)
        part_max = torch.empty((num_tokens, num_heads, num_segments), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # never touched
    _paged_attention_kernel[(num_programs, num_kv_heads, num_segments)](
        q, k_cache, v_cache, out, part_acc, part_max, part_sum,
        block_tables, seq_lens, query_start_loc, num_seqs, scale,
        k_scale if k_scale is not None else q, v_scale if v_scale is not None else q,  # (q: never read)
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        PAGE_SIZE=page_size, BLOCK_Q=block_q, BLOCK_N=DECODE_BLOCK_N if decode_only else MIXED_BLOCK_N,
        NUM_SEGMENTS=num_segments, DECODE_ONLY=decode_only, IEEE_DOT=q.dtype == torch.float32,
        WIDEN_FP16=widen_fp16,
        KV_SCALED=k_scale is not None,
        num_warps=NUM_WARPS if decode_only else MIXED_NUM_WARPS, num_stages=NUM_STAGES,
    )
    if num_segments > 1:
        combine(part_acc, part_max, part_sum, num_segments)
