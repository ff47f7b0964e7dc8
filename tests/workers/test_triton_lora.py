"""The LoRA Triton kernels (workers/lora/triton_lora.py) against the dense PyTorch path, in
Triton's interpreter on this CPU (on CUDA where there is one): rows on the base, on each slot,
a rank short of the slot's width, and an input split over several chunks."""

from __future__ import annotations

import pytest

from tests.workers.triton_interpreter import run_interpreted

CHECK = """
import sys
import torch
from workers.lora.triton_lora import add_lora
gen = torch.Generator().manual_seed(0)
slots, width, n_out, rows = 3, 24, 100, 7
n_in = int(sys.argv[1])   # 3 slots (slot 0: the base, zeros)
a = torch.randn(slots * width, n_in, generator=gen)
b = torch.randn(n_out, slots * width, generator=gen)
a[:width] = 0
b[:, :width] = 0
a[2 * width + 20:] = 0   # slot 2's adapter has rank 20 < width: padded with zeros
b[:, 2 * width + 20:] = 0
x = torch.randn(rows, n_in, generator=gen)
y = torch.randn(rows, n_out, generator=gen)
token_slots = torch.tensor([0, 1, 2, 2, 0, 1, 2])
shrink = x @ a.t()
shrink.masked_fill_((torch.arange(slots * width) // width) != token_slots[:, None], 0)
want = y + shrink @ b.t()
add_lora(x, y, a, b, token_slots, width)
err = float((y - want).abs().max() / want.abs().max())
assert err < 1e-5, err
assert torch.equal(y[0], want[0]) and torch.equal(y[4], want[4])  # the base's rows: untouched
print("ok")
"""


@pytest.mark.parametrize("n_in", [80, 600])  # one chunk of the input; three, the last one short
def test_the_kernels_add_each_rows_own_adapter_in_the_interpreter(n_in: int) -> None:
    pytest.importorskip("triton")
    run_interpreted(CHECK, args=[str(n_in)])
