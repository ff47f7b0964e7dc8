"""Masks the logits of grammar-constrained rows before sampling (the bitmask comes with the
batch from the scheduler, scheduler/grammar.py). Rows without a grammar are not touched.

The runner applies the mask right after filling it, while the step's forward may still run on
the device; nothing here waits for the device. On CUDA the bits (and the rows they belong to)
go up through pinned memory with asynchronous copies: a copy from pageable memory, or a
`torch.tensor(rows, device=...)`, would block the host until the forward is done, putting that
wait in front of the sampler's kernel launches.
"""

from __future__ import annotations

import torch

from shared.step import TokenBitmask


def apply_token_mask(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """Set to -inf, in place, the logits of every token the row's grammar refuses now."""
    # logits: [num_sampled, vocab]; mask.bits: int32 [len(mask.rows), ceil(vocab / 32)], CPU
    import xgrammar as xgr

    is_every_row = len(mask.rows) == logits.shape[0]
    if logits.device.type != "cuda":
        if is_every_row:
            xgr.apply_token_bitmask_inplace(logits, mask.bits)
        else:
            full = torch.full((logits.shape[0], mask.bits.shape[1]), -1, dtype=torch.int32)
            full[mask.rows] = mask.bits
            xgr.apply_token_bitmask_inplace(logits, full, indices=mask.rows)
        return
    bits = _upload(mask.bits, logits.device)
    if is_every_row:
        xgr.apply_token_bitmask_inplace(logits, bits)
        return
    # Int32 rows, as the kernel reads them.
    mask_rows(logits, bits, _upload(torch.tensor(mask.rows, dtype=torch.int32), logits.device))


def mask_rows(logits: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor, backend: str = "auto") -> None:
    """Mask logits rows `rows` with `bits` (row i for logits row rows[i]), all on one device.
    xgrammar's kernel reads row r of the bitmask for logits row r: the constrained rows' bits go
    there (the other rows are never read), and only those rows are masked."""
    # logits: [num_sampled, vocab]; bits: int32 [len(rows), words]; rows: int32 [len(rows)]
    import xgrammar as xgr

    full = torch.empty((logits.shape[0], bits.shape[1]), dtype=torch.int32, device=logits.device)
    full[rows] = bits
    xgr.apply_token_bitmask_inplace(logits, full, indices=rows, backend=backend)


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, copied without the host waiting: through pinned memory (PyTorch's
    caching host allocator keeps the pinned block until the copy is done)."""
    return host.pin_memory().to(device, non_blocking=True)
