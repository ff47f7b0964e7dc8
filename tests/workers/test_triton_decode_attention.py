"""The split-context decode kernel (triton_decode_attention.py, TOKENFLEET_DECODE_ATTENTION=split)
against the float64 reference of test_triton_attention.py, through triton_attention's entry
points as the engine calls them: decode-only steps (split and unsplit, short and long contexts),
the decode launch of a split mixed step, mixed-step graph slots with empty slots, FP8 caches; on
CUDA and, on CPU hosts, in Triton's interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.workers.triton_interpreter import ROOT, run_interpreted
from workers.layers import triton_attention

_CHECKS = """
import sys
import torch
from tests.workers.test_triton_attention import (DECODES, LONG_DECODES, LONG_MIXED, MIXED, make_step,
                                                 relative_error, slots_relative_error, with_fp8_cache)
from workers.layers import triton_attention, triton_decode_attention as split
triton_attention.DECODE_KERNEL = "split"
device, dtype = sys.argv[1], getattr(torch, sys.argv[2])
shape = dict(num_heads=8, num_kv_heads=2, head_dim=32, page_size=4, dtype=dtype, device=device)
if device == "cuda":
    shape = dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=dtype, device=device)
# (bf16 over FP8 in the interpreter: products in float16, as test_triton_attention's check allows)
tol = 1e-5 if dtype == torch.float32 else 1e-2 if device == "cuda" else 2e-2
# The interpreter's bf16 products are wrong for either kernel (the paged kernel's interpreter
# check runs bf16 q over FP8 caches only, widened to float16): there, only the FP8 checks.
plain = device == "cuda" or dtype == torch.float32
errors = {}
for tiles, block_n in [(4, 64), (1, 32)]:  # the defaults; a segment per tile, to split short contexts
    split.MIN_SEGMENT_TILES, split.BLOCK_N = tiles, block_n
    fp8 = with_fp8_cache(make_step(**LONG_DECODES, **shape), 0.5, 2.0)
    errors[f"fp8 {tiles}"] = relative_error(fp8, max_query_len=1)
    errors[f"fp8 split {tiles}"] = relative_error(fp8, max_query_len=1, num_segments=16)
    fp8_slots = with_fp8_cache(make_step(**LONG_MIXED, **shape), 0.5, 2.0)
    errors[f"fp8 slots {tiles}"] = slots_relative_error(fp8_slots, num_decodes=3, num_decode_slots=8)
    if not plain:
        continue
    for segments in (None, 1, 2, 16):
        errors[f"decodes {tiles} {block_n} {segments}"] = relative_error(
            make_step(**DECODES, **shape), max_query_len=1, num_segments=segments)
        errors[f"long {tiles} {block_n} {segments}"] = relative_error(
            make_step(**LONG_DECODES, **shape), max_query_len=1, num_segments=segments)
    errors[f"mixed {tiles}"] = relative_error(make_step(**MIXED, **shape), max_query_len=70, num_decodes=3)
    errors[f"slots {tiles}"] = relative_error(make_step(**LONG_MIXED, **shape), max_query_len=37,
                                              num_decodes=3, as_slots=True)
    errors[f"many slots {tiles}"] = slots_relative_error(make_step(**LONG_MIXED, **shape), num_decodes=3,
                                                         num_decode_slots=64)
worst = max(errors, key=errors.get)
assert errors[worst] < tol, (worst, errors[worst], errors)
print("ok")
"""


@pytest.mark.skipif(triton_attention.triton is None or torch.cuda.is_available(),
                    reason="needs Triton installed; on CUDA hosts the compiled kernel is tested instead")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_split_decode_kernel_matches_reference_in_the_interpreter(dtype) -> None:
    run_interpreted(_CHECKS, timeout_s=600, args=["cpu", dtype])


@pytest.mark.skipif(not torch.cuda.is_available() or triton_attention.triton is None,
                    reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_split_decode_kernel_matches_reference_on_cuda(dtype) -> None:
    # A process of its own (module settings changed for the check stay there), compiled.
    proc = subprocess.run([sys.executable, "-c", _CHECKS, "cuda", dtype], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.skipif(triton_attention.triton is None, reason="needs Triton installed")
def test_the_split_kernel_does_not_specialise_on_arguments_that_change_every_step() -> None:
    """As the paged kernel (test_cuda_paths.py): a variant compiled mid-serving costs ~1 s."""
    from workers.layers import triton_decode_attention

    flags = {p.name: (p.do_not_specialize, p.do_not_specialize_on_alignment)
             for p in triton_decode_attention._split_decode_kernel.params}
    assert flags["stride_table_seq"][0]
    assert all(flags[name][1] for name in ("block_tables_ptr", "seq_lens_ptr", "query_start_ptr"))


@pytest.mark.skipif(not torch.cuda.is_available() or triton_attention.triton is None,
                    reason="needs CUDA and Triton")
def test_an_engine_on_the_split_kernel_gives_the_paged_kernels_greedy_tokens(tiny_checkpoints,
                                                                             monkeypatch) -> None:
    """Decode graphs and eager steps alike (batches past the largest graph), float32."""
    import random

    from scheduler.engine import LLMEngine
    from shared.config import EngineConfig
    from shared.sampling import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 300))] for _ in range(11)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = {}
    for kernel in ("paged", "split"):
        monkeypatch.setattr(triton_attention, "DECODE_KERNEL", kernel)
        config = EngineConfig(model=str(tiny_checkpoints["llama"]), device="cuda", dtype="float32",
                              block_size=4, num_kv_blocks=2048, max_num_seqs=16, cuda_graph_max_batch_size=8)
        with LLMEngine(config) as engine:
            results[kernel] = [r.token_ids for r in engine.generate(prompts, greedy)]
    assert results["split"] == results["paged"]
