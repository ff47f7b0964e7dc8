"""scripts/bench_attention_gpu.py: the bytes a decode step must move, its tiny form on this CPU
in Triton's interpreter (a row per case and kernel), and a clear refusal where it cannot run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from testkit.attention_bench import HeadShape, paged_step, step_bytes
from workers.layers import triton_attention

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(triton_attention.triton is None, reason="needs Triton")


def _bench(*args: str, interpret: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)  # the script sets it for --device cpu
    if not interpret:
        env["TRITON_INTERPRET"] = "0"
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_attention_gpu.py"), *args],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def test_a_decode_step_moves_its_rows_kv_pages_and_q_and_out():
    shape = HeadShape(num_heads=4, num_kv_heads=2, head_dim=8, page_size=4)
    step = paged_step([1, 1], [9, 2], shape=shape, dtype=torch.float32, device="cpu")  # 10 and 3 tokens
    kv = (10 + 3) * 2 * 8 * 4 * 2  # tokens x KV heads x dim x float32 x (K and V)
    tables = (3 + 1) * 8  # pages of 4 tokens, int64 entries
    meta = (2 + 3) * 8  # seq_lens and query_start_loc, int64
    q_and_out = 2 * (2 * 4 * 8 * 4)
    assert step_bytes(step) == kv + tables + meta + q_and_out


@needs_triton
def test_the_tiny_form_prints_every_case_and_kernel_on_this_cpu():
    done = _bench("--device", "cpu", "--contexts", "40", "--batches", "2", "--mixed", "2,40,16,8",
                  "--kernels", "paged;split;split:BLOCK_N=16,MIN_SEGMENT_TILES=1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    cases = [tuple(cell.strip() for cell in line.split("|")[1:3]) for line in rows]
    tuned = "split:BLOCK_N=16,MIN_SEGMENT_TILES=1"
    assert cases == [("decode", "paged"), ("decode", "split"), ("decode", tuned),
                     ("mixed: prefill launch", "mixed"),
                     ("mixed: decode launch", "paged"), ("mixed: both, two launches", "paged"),
                     ("mixed: decode launch", "split"), ("mixed: both, two launches", "split"),
                     ("mixed: decode launch", tuned), ("mixed: both, two launches", tuned),
                     ("mixed: both, one launch", "mixed")], done.stdout
    assert "DIFFERS" not in done.stdout  # the split kernel's output agrees with the paged one's
    assert "copy" in done.stdout and "not a measurement" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_it_refuses_cuda_where_there_is_none_and_an_unknown_kernel():
    done = _bench("--device", "cuda", interpret=False)
    assert done.returncode == 2 and "CUDA is not available" in done.stderr, done.stderr[-2000:]
    done = _bench("--device", "cpu", "--kernels", "paged;fast")
    assert done.returncode == 2 and "--kernels fast" in done.stderr, done.stderr[-2000:]
    done = _bench("--device", "cpu", "--kernels", "split:BLOCK=32")
    assert done.returncode == 2 and "integer settings" in done.stderr, done.stderr[-2000:]
