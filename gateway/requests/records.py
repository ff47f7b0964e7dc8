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

import json
from collections.abc import Callable
from dataclasses import dataclass

from protocol.messages import REQUEST_STATES as STATES
from protocol.messages import TERMINAL_STATES, ErrorEvent, TokenEvent, unpack_list_chunks


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
                   event.usage, state=state)


def _text(raw: dict[bytes, bytes], name: str) -> str | None:
    value = raw.get(name.encode())
    return value.decode() if value is not None else None


def _float(raw: dict[bytes, bytes], name: str) -> float | None:
    value = raw.get(name.encode())
    return float(value) if value not in (None, b"") else None


@dataclass
class ResultRecord:
    """A parsed `tf:res:{id}` hash."""

    req_id: str
    state: str
    seq: int
    token_ids: list[int]
    text: str
    logprobs: list | None
    offsets: list | None
    finish_reason: str | None
    usage: dict | None
    error: dict | None
    owner: str | None
    model: str | None
    api: str | None  # "chat" or "completion" (written by the gateway)
    top_logprobs: int | None  # the logprobs the client asked for (written by the gateway)
    tool_format: str | None  # chat with tools: how calls are read from the text (written by the gateway)
    parallel_tool_calls: bool
    prompt_tokens: int
    queued_at: float | None
    started_at: float | None
    first_token_at: float | None
    finished_at: float | None
    deadline: float | None
    entry_id: str | None
    tenant: str | None = None  # whose request (its stream and its lease are the tenant's)

    @classmethod
    def parse(cls, req_id: str, raw: dict[bytes, bytes]) -> ResultRecord | None:
        if not raw:
            return None
        state = _text(raw, "state") or "queued"
        token_ids = unpack_list_chunks(raw[b"token_ids"]) if b"token_ids" in raw else []
        top = _text(raw, "top_logprobs")
        return cls(
            req_id=req_id, state=state if state in STATES else "queued", seq=int(raw.get(b"seq", 0)),
            token_ids=token_ids, text=_text(raw, "text") or "",
            logprobs=unpack_list_chunks(raw[b"logprobs"]) if b"logprobs" in raw else None,
            offsets=unpack_list_chunks(raw[b"offsets"]) if b"offsets" in raw else None,
            finish_reason=_text(raw, "finish_reason") or None,
            usage=json.loads(raw[b"usage"]) if b"usage" in raw else None,
            error=json.loads(raw[b"error"]) if b"error" in raw else None,
            owner=_text(raw, "owner"), model=_text(raw, "model"), api=_text(raw, "api"),
            top_logprobs=int(top) if top not in (None, "") else None,
            tool_format=_text(raw, "tool_format") or None,
            parallel_tool_calls=_text(raw, "parallel_tool_calls") != "0",
            prompt_tokens=int(raw.get(b"prompt_tokens", 0)),
            queued_at=_float(raw, "queued_at"), started_at=_float(raw, "started_at"),
            first_token_at=_float(raw, "first_token_at"), finished_at=_float(raw, "finished_at"),
            deadline=_float(raw, "deadline"), entry_id=_text(raw, "entry_id"), tenant=_text(raw, "tenant"),
        )

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_STATES

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
        if self.is_terminal:
            delta.state = self.state
            delta.finish_reason = self.finish_reason
            delta.usage = self.final_usage()
            delta.error = self.error
        return delta
