"""One generation request as the scheduler tracks it, from arrival to finish."""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field

from scheduler.lora_slots import RegisteredLora
from shared.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; will re-prefill from scratch
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    def __init__(self, value: str) -> None:
        # A plain attribute, not a set lookup: read ~700 times per engine step in a burst, and an
        # enum member's hash is a Python call.
        self.is_finished = value.startswith("finished_")


class FinishReason(str, enum.Enum):
    """Why a request ended, spelled as OpenAI's finish_reason."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


FINISH_REASON_OF_STATUS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass
class TokenLogprobs:
    """Log-probabilities reported for one generated token."""

    token_id: int
    logprob: float | None  # of the chosen token
    top_logprobs: list[tuple[int, float]] | None = None  # (token_id, logprob), best first


# Batch work runs at this priority and above (the service adds it to a batch item's own
# priority): below every interactive request, whose priority is an int32.
BATCH_PRIORITY = 2**32


# eq=False: requests compare by identity; two requests are never "equal" field by field,
# and list.remove / `in` on the scheduler's queues stay cheap.
@dataclass(eq=False)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0  # lower number = more important; BATCH_PRIORITY and above: batch work
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: set[int] = field(default_factory=set)
    tenant: str | None = None  # whose request: tenants take turns inside a priority
    # Rotary table row offset of this request (SequenceWork.rope_offset; 0 for most models).
    rope_offset: int = 0
    lora: RegisteredLora | None = None  # the adapter it runs with; None: the base model

    output_token_ids: list[int] = field(default_factory=list)
    # Tokens of all_token_ids whose K/V sit in the cache. What to compute next is always
    # all_token_ids[num_computed_tokens:], so chunked prefill, decode and resume after
    # preemption (which resets this to 0) are the same rule.
    num_computed_tokens: int = 0
    # Steps submitted and not yet taken back (a pipeline's, or async scheduling's step ahead):
    # the tokens they compute for this request, and how many of those steps sample a token that
    # is still on the device. The next step starts at num_planned_tokens; a pending token is
    # the input of the step after the one that samples it (the runner takes it on the device).
    num_in_flight_tokens: int = 0
    num_pending_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)  # block table, in position order
    # Prefix caching: the hash of each full block of all_token_ids so far (they never change),
    # how many of block_ids are findable by their hash, and how many prompt tokens the first
    # admission found in the cache (None until admitted; reported as usage's cached_tokens).
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int | None = None
    # Host tier (scheduler/host_tier.py): the step whose copies load this request's prefix into
    # its blocks; it runs no step before that one is back. None: not loading.
    loading_step_id: int | None = None

    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # The stop string or stop token id that ended the request; None for EOS, length, abort.
    stop_reason: str | int | None = None
    output_text: str = ""  # text streamed so far (stop strings and held-back text excluded)
    # One entry per output token (but a stop token that ended it), only when sampling.logprobs is set.
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # sampling.prompt_logprobs set: entry i scores prompt token i + 1 ([token_id, logprob, top]),
    # filled chunk by chunk as the prefill's steps come back; sent with the first output token.
    prompt_logprobs: list[list] = field(default_factory=list)
    is_prompt_logprobs_sent: bool = False
    num_preemptions: int = 0
    # The step that last computed a token of it: a step's latency budget leaves out the less
    # important decodes that ran most recently first (scheduler._less_important_order).
    last_scheduled_step: int = -1
    # What the workers need of `sampling` (sent with every step of this request): without the
    # grammar, stop strings and stop token ids, which only the scheduler reads and which can be
    # kilobytes.
    worker_sampling: SamplingParams = field(init=False)
    # sampling.stop_token_ids as a set, built once: looked up for every token of the request.
    stop_token_set: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        sampling = self.sampling
        scheduler_only = sampling.grammar is not None or bool(sampling.stop) or bool(sampling.stop_token_ids)
        self.worker_sampling = (dataclasses.replace(sampling, grammar=None, stop=[], stop_token_ids=[])
                                if scheduler_only else sampling)
        self.stop_token_set = frozenset(sampling.stop_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Tokens whose K/V is in the cache or being computed by a step in flight."""
        return self.num_computed_tokens + self.num_in_flight_tokens

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens (a new list; use token_ids_slice for a window)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def ended_on_stop_token(self) -> bool:
        """Stopped by its last token being EOS or a stop token id (which add no text), not by a
        stop string or the length."""
        return self.status == RequestStatus.FINISHED_STOPPED and not isinstance(self.stop_reason, str)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (hot path: every step)."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def finish(self, status: RequestStatus, stop_reason: str | int | None = None) -> None:
        self.status = status
        self.finish_reason = FINISH_REASON_OF_STATUS[status]
        self.stop_reason = stop_reason
