"""What a request's client has been sent so far, and what one step adds to it.

Owned by the result publisher's process (service/publisher_process.py) alone: the engine's
process says what a step produced (`StepOutput`, plain values) and never sees seq, text or
offsets. One owner is what keeps `seq` gap-free while the two processes run side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from scheduler.detokenizer import IncrementalDetokenizer


@dataclass
class Delivery:
    """A request this scheduler owns, as its client sees it: events sent, tokens, text."""

    req_id: str
    stream: str
    entry_id: str
    num_prompt_tokens: int
    seq: int = 0  # events published so far
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None  # sent with the first token, when asked for
    # After event k: (tokens, characters) delivered so far, so a reader can replay the
    # events after any seq from the stored record (SSE resume with Last-Event-ID).
    offsets: list = field(default_factory=list)
    wants_logprobs: bool = False
    first_token_at: float | None = None
    batch_job_id: str | None = None  # a batch item: written only when it ends, nobody streams it
    # The prompt's last ids and what earlier owners delivered, when this process makes the text
    # (None: the engine makes it, because stop strings need it there).
    detokenize_after: list[int] | None = None
    detokenizer: IncrementalDetokenizer | None = None

    @property
    def is_batch(self) -> bool:
        return self.batch_job_id is not None


class StepOutput(NamedTuple):
    """What one step added to one request, in plain values (it crosses to the publisher's
    process as a tuple: pickling a tuple of lists and numbers is the cheapest there is)."""

    req_id: str
    new_token_ids: list[int]
    text_delta: str  # "" when the publisher makes the text
    finished: bool
    finish_reason: str | None  # FinishReason's value
    stop_reason: str | int | None
    # (token_id, logprob, top_logprobs) per new token; None if not asked for
    logprobs: list | None
    num_cached_tokens: int
    prompt_logprobs: list | None = None  # [token_id, logprob, top] per prompt token, once
    embedding: bytes | None = None  # an embedding request's vector (float32), on its one output

    @classmethod
    def of(cls, out) -> tuple:
        """A scheduler.RequestOutput as the tuple that crosses."""
        logprobs = None
        if out.logprobs:
            logprobs = [[lp.token_id, lp.logprob, lp.top_logprobs] for lp in out.logprobs]
        return (out.req_id, out.new_token_ids, out.text_delta, out.finished,
                None if out.finish_reason is None else out.finish_reason.value, out.stop_reason,
                logprobs, out.num_cached_tokens, out.prompt_logprobs, out.embedding)
