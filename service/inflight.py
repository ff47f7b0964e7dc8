"""A scheduler service's settings, and the requests it owns with what each client has been sent."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.detokenizer import IncrementalDetokenizer


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
    # Claims are renewed on a thread of their own, also during a long step; a tick that has not
    # ended after this long is a hung scheduler, whose claims are left to lapse.
    max_tick_s: float = 300.0


@dataclass
class InFlight:
    """A request this scheduler owns, and what its client has been sent so far."""

    req_id: str
    stream: str
    entry_id: str
    num_prompt_tokens: int
    seq: int = 0  # events published so far
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    # After event k: (tokens, characters) delivered so far, so a reader can replay the
    # events after any seq from the stored record (SSE resume with Last-Event-ID).
    offsets: list = field(default_factory=list)
    wants_logprobs: bool = False
    deadline: float | None = None
    first_token_at: float | None = None
    batch_job_id: str | None = None  # a batch item: written only when it ends, nobody streams it
    # Turns its tokens into text on the writer thread (None: the engine does it, for stop strings).
    detokenizer: IncrementalDetokenizer | None = None

    @property
    def is_batch(self) -> bool:
        return self.batch_job_id is not None
