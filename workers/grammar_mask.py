"""Masks the logits of grammar-constrained rows before sampling (the bitmask comes with the
batch from the scheduler, scheduler/grammar.py). Rows without a grammar are not touched.

The runner applies the mask right after filling it, while the step's forward may still run on
the device; nothing here waits for the device. On CUDA the bits (and the rows they belong to)
go up from pinned staging buffers with asynchronous copies: a copy from pageable memory would
be staged synchronously and a `torch.tensor(rows, device=...)` would block the host, putting
the wait for the forward in front of the sampler's launches.
"""

from __future__ import annotations

import torch

from shared.step import TokenBitmask


class TokenMaskApplier:
    """One runner's way of applying grammar masks to its logits (pinned staging on CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned_bits: torch.Tensor | None = None  # int32 [capacity rows, words]
        self._pinned_rows: torch.Tensor | None = None  # int32 [capacity rows]
        # Recorded after the last uploads from the staging buffers: they are not rewritten
        # before those copies are done.
        self._uploaded: torch.cuda.Event | None = None

    def apply(self, logits: torch.Tensor, mask: TokenBitmask) -> None:
        """Set to -inf, in place, the logits of every token the row's grammar refuses now."""
        # logits: [num_sampled, vocab]; mask.bits: int32 [len(mask.rows), ceil(vocab / 32)], CPU
        import xgrammar as xgr

        is_every_row = len(mask.rows) == logits.shape[0]
        if logits.device.type != "cuda":
            if is_every_row:
                xgr.apply_token_bitmask_inplace(logits, mask.bits)
            else:
                full = self._full_height(mask.bits, mask.rows, logits.shape[0])
                xgr.apply_token_bitmask_inplace(logits, full, indices=mask.rows)
            return
        bits, rows = self._upload(mask, logits.device, with_rows=not is_every_row)
        if is_every_row:
            xgr.apply_token_bitmask_inplace(logits, bits)
            return
        # xgrammar's kernel reads row r of the bitmask for logits row r: place the constrained
        # rows' bits there (the other rows are never read) and mask those rows only.
        full = torch.empty((logits.shape[0], bits.shape[1]), dtype=bits.dtype, device=bits.device)
        full[rows] = bits
        xgr.apply_token_bitmask_inplace(logits, full, indices=rows)  # int32 rows: as the kernel reads them

    @staticmethod
    def _full_height(bits: torch.Tensor, rows: list[int], num_rows: int) -> torch.Tensor:
        full = torch.full((num_rows, bits.shape[1]), -1, dtype=bits.dtype)
        full[rows] = bits
        return full

    def _upload(self, mask: TokenBitmask, device: torch.device,
                with_rows: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        bits: torch.Tensor = mask.bits
        num_rows, words = bits.shape
        if self._uploaded is not None:
            self._uploaded.synchronize()  # at once, as a rule: the last step's sampler synchronised
        staging = self._pinned_bits
        if staging is None or staging.shape[0] < num_rows or staging.shape[1] != words:
            capacity = max(num_rows, 64)
            self._pinned_bits = torch.empty((capacity, words), dtype=torch.int32, pin_memory=True)
            self._pinned_rows = torch.empty(capacity, dtype=torch.int32, pin_memory=True)
        staged_bits = self._pinned_bits[:num_rows]
        staged_bits.copy_(bits)
        on_device = staged_bits.to(device, non_blocking=True)
        rows = None
        if with_rows:
            staged_rows = self._pinned_rows[:num_rows]
            staged_rows.copy_(torch.as_tensor(mask.rows, dtype=torch.int32))
            rows = staged_rows.to(device, non_blocking=True)
        if self._uploaded is None:
            self._uploaded = torch.cuda.Event()
        self._uploaded.record()
        return on_device, rows


def apply_token_mask(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """Apply `mask` to `logits` in place, without a runner's staging buffers (tests, tools)."""
    TokenMaskApplier(logits.device).apply(logits, mask)
