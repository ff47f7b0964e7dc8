"""The LoRA expand kernel (workers/lora/triton_lora.py) against the dense PyTorch path, in
Triton's interpreter on this CPU (on CUDA where there is one): rows on the base and on each
slot, a rank short of the slot's width, a width tl.dot must pad, column slices of one product
as its inputs, and more rows than one tile holds."""

from __future__ import annotations

import pytest

from tests.workers.triton_interpreter import run_interpreted

CHECK = """
import sys
import torch
from workers.lora.triton_lora import expand_lora
gen = torch.Generator().manual_seed(0)
width, rows = int(sys.argv[1]), int(sys.argv[2])
slots, n_out = 4, 100   # slot 0: the base, zeros
bt = torch.randn(slots * width, n_out, generator=gen)
bt[:width] = 0
bt[2 * width + width // 2:3 * width] = 0   # slot 2's adapter has a rank short of the width
product = torch.randn(rows, n_out + slots * width, generator=gen)   # the stacked product
base, shrink = product[:, :n_out], product[:, n_out:]
token_slots = torch.tensor([0, 1, 2, 3, 0, 2, 1] * 20)[:rows]
masked = shrink.masked_fill((torch.arange(slots * width) // width) != token_slots[:, None], 0)
want = base + masked @ bt
got = expand_lora(shrink, base, bt, token_slots, width)
assert got.is_contiguous() and got.shape == want.shape
err = float((got - want).abs().max() / want.abs().max())
assert err < 1e-5, err
base_rows = token_slots == 0
assert torch.equal(got[base_rows], base[base_rows])  # the base's rows: copied, nothing added
print("ok")
"""


# one tile; a width tl.dot pads; two tiles
@pytest.mark.parametrize(("width", "rows"), [(24, 7), (8, 7), (48, 70)])
def test_the_kernel_adds_each_rows_own_adapter_in_the_interpreter(width: int, rows: int) -> None:
    pytest.importorskip("triton")
    run_interpreted(CHECK, args=[str(width), str(rows)])
