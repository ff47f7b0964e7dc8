"""Async scheduling on a rank: a step's input tokens taken from the previous step's samples on
the device, never through the host.

The scheduler plans step n+1 before step n's tokens are back: a request decoding in both has
its work in step n+1 marked `is_token_pending` (one token, value unknown to the host). The runner
keeps step n's sampled ids on the device with the row of each request (`keep`); once step n+1's
inputs are built, `fill` gathers the pending rows' ids from there and scatters them into the
step's token-id tensor (a graph's static buffer, or the eager step's), in stream order after
step n's sampler and before step n+1's forward.

Every input layout (eager, decode graphs, mixed graphs) puts the one-token works first in batch
order, so a pending work's row is its index among them. Under tensor parallelism every rank
embeds the tokens: the driver broadcasts its sampled ids to the stage's ranks (`share`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from shared.step import SequenceWork
from workers.host_staging import HostStaging
from workers.parallel import TensorParallel


class PendingTokens:
    def __init__(self, device: torch.device, staging: HostStaging | None = None) -> None:
        """staging: the runner's upload ring (None: one of its own)."""
        self.device = device
        self.staging = staging or HostStaging(device)
        self._token_ids: torch.Tensor | None = None  # [num_sampled] long: the last step's samples
        self._row_of: dict[str, int] = {}  # req_id -> its row in _token_ids

    def keep(self, sampled_works: list[SequenceWork], token_ids: torch.Tensor | None) -> None:
        """Remember the step's sampled ids (replacing the last step's: a pending token is always
        the previous step's)."""
        self._token_ids = token_ids
        self._row_of = {w.req_id: i for i, w in enumerate(sampled_works)} if token_ids is not None else {}

    def fill(self, token_ids: torch.Tensor, works: list[SequenceWork]) -> None:
        """Write each pending work's token into its row of `token_ids` ([>= num_tokens] long, laid
        out one-token works first) on the device."""
        decodes = [w for w in works if len(w.token_ids) == 1]
        dst = [row for row, w in enumerate(decodes) if w.is_token_pending]
        if not dst:
            return
        missing = [decodes[row].req_id for row in dst if decodes[row].req_id not in self._row_of]
        if missing:
            raise RuntimeError(f"{missing[0]}: its input is the previous step's token, which this rank "
                               "did not sample (was the group restarted?)")
        src = [self._row_of[decodes[row].req_id] for row in dst]
        index = self.staging.upload(np.array(dst + src, dtype=np.int64))
        # index_select / index_copy_ rather than advanced indexing: kernels only, with no
        # host-side look at the indices (the step ahead is launched while this one runs).
        token_ids.index_copy_(0, index[: len(dst)], self._token_ids.index_select(0, index[len(dst):]))


    def penalized_ids(self, sampled_works: list[SequenceWork]) -> torch.Tensor | None:
        """For the step's sampled rows ([num_sampled] long, on the device): the pending input token
        of a penalized row (the last of its output, missing from the history it was sent with),
        -1 for every other row; None when no penalized row has one."""
        src = [-1] * len(sampled_works)
        for i, work in enumerate(sampled_works):
            if work.is_token_pending and work.sampling.has_penalties:
                if work.req_id not in self._row_of:
                    raise RuntimeError(f"{work.req_id}: its pending token was not sampled by this rank")
                src[i] = self._row_of[work.req_id]
        if all(row < 0 for row in src):
            return None
        index = self.staging.upload(np.array(src, dtype=np.int64))
        ids = self._token_ids.index_select(0, index.clamp(min=0))
        return torch.where(index >= 0, ids, -1)


def share(tp: TensorParallel, token_ids: torch.Tensor | None, num_rows: int,
          device: torch.device) -> torch.Tensor:
    """The driver's sampled ids on every rank of its tensor-parallel group (a broadcast from
    the group's rank 0; the others pass None and get theirs)."""
    if tp.size == 1:
        return token_ids
    if token_ids is None:
        token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
    src = 0 if tp.group is None else dist.get_global_rank(tp.group, 0)
    dist.broadcast(token_ids, src=src, group=tp.group)
    return token_ids
