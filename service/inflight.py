"""A scheduler service's settings, and the requests it owns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServiceSettings:
    model_name: str
    scheduler_id: str
    lease_s: float = 10.0  # an entry nobody renewed for this long is taken over
    heartbeat_s: float = 1.0  # heartbeat, claim renewal and takeover checks, this often
    max_deliveries: int = 3  # more deliveries than this: the entry is poison -> tf:dead
    result_ttl_s: int = 24 * 3600
    idle_block_ms: int = 100  # how long an idle scheduler waits on the streams
    log_stats_interval_s: float = 5.0  # the throughput log line, this often while busy (0: never)
    steal_after_s: float = 2.0  # an idle scheduler takes a live peer's routed entries unread this long
    num_publishers: int = 2  # result publisher processes (service/result_publisher.py)
    # Claims are renewed on a thread of their own, also during a long step; a tick that has not
    # ended after this long is a hung scheduler, whose claims are left to lapse.
    max_tick_s: float = 300.0


@dataclass
class InFlight:
    """A request this scheduler owns: its stream entry (acknowledged with its terminal state)
    and what admission and expiry need. What its client was sent is the publisher's
    (service/delivery.py), in another process."""

    req_id: str
    stream: str
    entry_id: str
    deadline: float | None = None
    batch_job_id: str | None = None  # a batch item: written only when it ends, nobody streams it

    @property
    def is_batch(self) -> bool:
        return self.batch_job_id is not None


class Flights(dict[str, InFlight]):
    """req_id -> InFlight, counting its changes and its batch items, so that what a tick needs of
    it costs nothing per step: the entries the claim renewer is given are rebuilt only when
    `version` moved, and the admission room reads `num_batch` instead of summing every flight."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 0
        self.num_batch = 0

    def __setitem__(self, req_id: str, flight: InFlight) -> None:
        old = super().get(req_id)
        self.num_batch += flight.is_batch - (old is not None and old.is_batch)
        super().__setitem__(req_id, flight)
        self.version += 1

    def __delitem__(self, req_id: str) -> None:
        self.pop(req_id)

    _MISSING = object()

    def pop(self, req_id: str, default=_MISSING):  # type: ignore[override]
        flight = super().pop(req_id, None) if default is not self._MISSING else super().pop(req_id)
        if flight is None:
            return default
        self.num_batch -= flight.is_batch
        self.version += 1
        return flight

    def _unsupported(self, *args, **kwargs):
        raise TypeError("Flights changes one request at a time (its counts would be wrong)")

    update = setdefault = popitem = clear = _unsupported  # type: ignore[assignment]
