"""What a client is sent, read from the two places a request's progress lives: its events
(pub/sub) and its `tf:res:{id}` record. Both become `Delta`s, so a stream that mixes a
catch-up from the record with live events carries each sequence number exactly once.

Per-event boundaries: the record holds the whole output so far; the proposed `offsets`
field (msgpack list, one [num_tokens, num_chars] per seq, cumulative; an entry may be nil
where a scheduler did not record it) says where each event ended, so a replay after any
Last-Event-ID is exact. Without it, one token per event is assumed (what the scheduler
produces) and the text boundary is where the decoded tokens stop matching the stored text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from protocol import result_record
from protocol.messages import ErrorEvent, TokenEvent


@dataclass(slots=True)
class Delta:
    """New output of one request: the events in (previous seq, seq], merged."""

    seq: int
    token_ids: list[int]
    text: str
    logprobs: list | None = None  # per token: [token_id, logprob, [[id, logprob], ...] | None]
    finish_reason: str | None = None
    usage: dict | None = None
    error: dict | None = None  # {"code", "message"} when the request ended without finishing
    state: str | None = None  # the terminal state, on the last delta only
    # The prompt's logprobs (asked for), on the delta of the first token: see TokenEvent.
    prompt_logprobs: list | None = None

    @property
    def is_final(self) -> bool:
        return self.state is not None

    @classmethod
    def from_event(cls, event: TokenEvent | ErrorEvent) -> Delta:
        if isinstance(event, ErrorEvent):
            state = event.code if event.code in ("cancelled", "expired") else "failed"
            return cls(event.seq, [], "", error={"code": event.code, "message": event.message}, state=state)
        state = None
        if event.finish_reason is not None:
            state = "cancelled" if event.finish_reason == "abort" else "completed"
        return cls(event.seq, event.token_ids, event.text, event.logprobs, event.finish_reason,
                   event.usage, state=state, prompt_logprobs=event.prompt_logprobs)


class ResultRecord(result_record.ResultRecord):
    """A parsed `tf:res:{id}` hash (protocol/result_record.py), and what a client is sent from it."""

    def final_usage(self) -> dict:
        if self.usage is not None:
            return self.usage
        num_out = len(self.token_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": num_out,
                "total_tokens": self.prompt_tokens + num_out}

    def position(self, seq: int, decode: Callable[[list[int]], str]) -> tuple[int, int]:
        """(num_tokens, num_chars) a client has after the event `seq`."""
        if seq <= 0:
            return 0, 0
        if seq >= self.seq:
            return len(self.token_ids), len(self.text)
        if self.offsets is not None and seq <= len(self.offsets) and self.offsets[seq - 1] is not None:
            num_tokens, num_chars = self.offsets[seq - 1]
            return num_tokens, num_chars
        num_tokens = min(seq, len(self.token_ids))  # no offsets: one token per event
        decoded = decode(self.token_ids[:num_tokens])
        num_chars = 0
        for a, b in zip(decoded, self.text, strict=False):
            if a != b:
                break
            num_chars += 1
        return num_tokens, num_chars

    def delta_after(self, after_seq: int, decode: Callable[[list[int]], str]) -> Delta:
        """Everything in (after_seq, self.seq] as one delta; final when the record is terminal."""
        num_tokens, num_chars = self.position(after_seq, decode)
        logprobs = self.logprobs[num_tokens:] if self.logprobs is not None else None
        delta = Delta(self.seq, self.token_ids[num_tokens:], self.text[num_chars:], logprobs)
        if num_tokens == 0:  # (they came with the first token)
            delta.prompt_logprobs = self.prompt_logprobs
        if self.is_terminal:
            delta.state = self.state
            delta.finish_reason = self.finish_reason
            delta.usage = self.final_usage()
            delta.error = self.error
        return delta
