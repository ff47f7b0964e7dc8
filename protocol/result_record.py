"""The `tf:res:{id}` record of a request: every field's name, who sets it, and its one parser.

The gateway creates the record (queued), a scheduler owns it from the claim on (running, each
step's progress, the terminal write), and the gateway and the batch ingester read it back. All of
them build and read the hash through this module; tests/protocol/test_result_record_ownership.py
fails when a field name is spelled anywhere else. (The Lua scripts name the fields they touch in
their own text: the write script in service/result_store.py, the submit and finish-unclaimed
scripts in gateway/serving/store.py.)
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field
from enum import Enum

from protocol.messages import REQUEST_STATES, TERMINAL_STATES, pack_list_chunk, unpack_list_chunks


class F:
    """The hash's field names (plain strings: they are the Redis field names themselves)."""

    # Set by the gateway (or the batch ingester) when the request is queued.
    STATE = "state"
    MODEL = "model"
    API = "api"  # "chat" or "completion"
    QUEUED_AT = "queued_at"
    PROMPT_TOKENS = "prompt_tokens"
    DEADLINE = "deadline"
    TOP_LOGPROBS = "top_logprobs"  # the logprobs the client asked for
    PROMPT_TOP_LOGPROBS = "prompt_top_logprobs"  # vLLM's prompt_logprobs, as the client asked
    ECHO = "echo"  # JSON [prompt text, prompt only (max_tokens 0)]: a completion with echo
    TOOL_FORMAT = "tool_format"  # chat with tools: how calls are read from the text
    PARALLEL_TOOL_CALLS = "parallel_tool_calls"
    TENANT = "tenant"  # the terminal write ends the request's lease on it
    ENTRY_ID = "entry_id"  # the request's stream entry (set by the submit script)
    STREAM = "stream"  # the stream it went to, when not the model's own (set by the submit script)
    BATCH_JOB = "batch_job"
    BATCH_INDEX = "batch_index"
    BATCH_N = "batch_n"
    BATCH_LINE = "batch_line"
    CUSTOM_ID = "custom_id"
    # Set by the scheduler that owns it.
    OWNER = "owner"
    SCHEDULER = "scheduler"
    STARTED_AT = "started_at"
    RESUMED_FROM_SEQ = "resumed_from_seq"
    SEQ = "seq"
    TOKEN_IDS = "token_ids"  # msgpack list chunks, appended per step
    TEXT = "text"  # appended per step
    LOGPROBS = "logprobs"  # msgpack list chunks
    PROMPT_LOGPROBS = "prompt_logprobs"  # msgpack list, set with the first token (when asked for)
    OFFSETS = "offsets"  # msgpack list chunks: per event, [num_tokens, num_chars] so far
    FIRST_TOKEN_AT = "first_token_at"
    FINISHED_AT = "finished_at"
    FINISH_REASON = "finish_reason"
    STOP_REASON = "stop_reason"
    USAGE = "usage"  # JSON
    ERROR = "error"  # JSON: {"code": ErrorCode, "message"}
    EMBEDDING = "embedding"  # an embedding request's vector: base64 of little-endian float32


class RequestState(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


assert tuple(s.value for s in RequestState) == REQUEST_STATES


class ErrorCode(str, Enum):
    """The `code` of a record's `error` (and of an ErrorEvent)."""

    CANCELLED = "cancelled"
    EXPIRED = "expired"
    DEAD_LETTER = "dead_letter"  # delivered too often, or undecodable: set aside in tf:dead
    INVALID_REQUEST = "invalid_request"  # the scheduler refused the input itself: a client's 400


# The error message of a request that expired before any scheduler ran it (gateway or scheduler).
EXPIRED_MESSAGE = "the deadline passed while it was queued"


def _value(value: object) -> object:
    return value.value if isinstance(value, Enum) else value


# -- building ------------------------------------------------------------------------------


def queued_fields(*, model: str, api: str, queued_at: float, prompt_tokens: int,
                  deadline: float | None = None, top_logprobs: int | None = None,
                  prompt_top_logprobs: int | None = None, echo: tuple[str, bool] | None = None,
                  tool_format: str | None = None,
                  parallel_tool_calls: bool = True, tenant: str | None = None,
                  batch: tuple[str, int, int, str, str] | None = None) -> dict[str, object]:
    """The record a gateway (or the batch ingester) creates; batch: (job, index, n, line, custom_id)."""
    fields: dict[str, object] = {F.STATE: RequestState.QUEUED.value, F.MODEL: model, F.API: api,
                                 F.QUEUED_AT: queued_at, F.PROMPT_TOKENS: prompt_tokens}
    if batch is not None:
        job, index, n, line, custom_id = batch
        fields.update({F.BATCH_JOB: job, F.BATCH_INDEX: index, F.BATCH_N: n, F.BATCH_LINE: line,
                       F.CUSTOM_ID: custom_id})
    if deadline is not None:
        fields[F.DEADLINE] = deadline
    if top_logprobs is not None:
        fields[F.TOP_LOGPROBS] = top_logprobs
    if prompt_top_logprobs is not None:
        fields[F.PROMPT_TOP_LOGPROBS] = prompt_top_logprobs
    if echo is not None:
        fields[F.ECHO] = json.dumps(list(echo))
    if tool_format is not None:
        fields[F.TOOL_FORMAT] = tool_format
        fields[F.PARALLEL_TOOL_CALLS] = int(parallel_tool_calls)
    if tenant is not None:
        fields[F.TENANT] = tenant
    return fields


def running_fields(*, model: str, prompt_tokens: int, scheduler: str, resumed_from_seq: int = 0,
                   started_at: float | None = None) -> dict[str, object]:
    """What a scheduler sets when it starts a request."""
    fields: dict[str, object] = {F.STATE: RequestState.RUNNING.value, F.MODEL: model,
                                 F.STARTED_AT: time.time() if started_at is None else started_at,
                                 F.PROMPT_TOKENS: prompt_tokens, F.SCHEDULER: scheduler}
    if resumed_from_seq:
        fields[F.RESUMED_FROM_SEQ] = resumed_from_seq
    return fields


def error_json(code: ErrorCode | str, message: str | None) -> str:
    return json.dumps({"code": _value(code), "message": message})


def terminal_fields(state: RequestState | str, *, error_code: ErrorCode | str | None = None,
                    error_message: str | None = None, seq: int | None = None,
                    finish_reason: str | None = None, usage: dict | None = None,
                    stop_reason: object = None) -> dict[str, object]:
    """The fields of the write that ends a request."""
    fields: dict[str, object] = {F.STATE: _value(state), F.FINISHED_AT: time.time()}
    if seq is not None:
        fields[F.SEQ] = seq
    if finish_reason is not None:
        fields[F.FINISH_REASON] = finish_reason
    if usage is not None:
        fields[F.USAGE] = json.dumps(usage)
    if stop_reason is not None:
        fields[F.STOP_REASON] = str(stop_reason)
    if error_code is not None:
        fields[F.ERROR] = error_json(error_code, error_message)
    return fields


def embedding_fields(vector: bytes) -> dict[str, object]:
    """An embedding request's result (float32 bytes), set with its terminal write."""
    return {F.EMBEDDING: base64.b64encode(vector).decode("ascii")}


def step_fields(seq: int, *, first_token_at: float | None = None) -> dict[str, object]:
    """What one step sets (its appends come from step_appends)."""
    fields: dict[str, object] = {F.SEQ: seq}
    if first_token_at is not None:
        fields[F.FIRST_TOKEN_AT] = first_token_at
    return fields


def step_appends(offsets_chunk: bytes, *, token_ids_chunk: bytes | None = None, text: str = "",
                 logprobs_chunk: bytes | None = None) -> dict[str, str | bytes]:
    """What one step appends to the record (only the new part is packed and sent)."""
    appends: dict[str, str | bytes] = {F.OFFSETS: offsets_chunk}
    if token_ids_chunk is not None:
        appends[F.TOKEN_IDS] = token_ids_chunk
    if text:
        appends[F.TEXT] = text
    if logprobs_chunk is not None:
        appends[F.LOGPROBS] = logprobs_chunk
    return appends


def progress_fields(seq: int, text: str, token_ids_chunk: bytes, offsets_chunk: bytes | None, *,
                    first_token_at: float | None = None,
                    logprobs_chunk: bytes | None = None) -> dict[str, object]:
    """Everything delivered so far, set at once (a batch item's record, written at its end)."""
    fields: dict[str, object] = {F.SEQ: seq, F.TEXT: text, F.TOKEN_IDS: token_ids_chunk}
    if offsets_chunk is not None:  # (a record without offsets is still read: one token per event)
        fields[F.OFFSETS] = offsets_chunk
    if first_token_at is not None:
        fields[F.FIRST_TOKEN_AT] = first_token_at
    if logprobs_chunk is not None:
        fields[F.LOGPROBS] = logprobs_chunk
    return fields


def prompt_logprobs_fields(entries: list) -> dict[str, object]:
    """The prompt's logprobs, set once with the first token: [token_id, logprob, top] each."""
    return {F.PROMPT_LOGPROBS: pack_list_chunk(entries)}


def is_terminal_write(fields: dict[str, object]) -> bool:
    return fields.get(F.STATE) in TERMINAL_STATES


# -- reading -------------------------------------------------------------------------------

# The cheap looks: a few fields by HMGET instead of the whole hash.
PROGRESS_FIELDS = (F.STATE, F.SEQ, F.OWNER, F.DEADLINE)
TIMING_FIELDS = (F.QUEUED_AT, F.STARTED_AT)


def _text(raw: dict[bytes, bytes], name: str) -> str | None:
    value = raw.get(name.encode())
    return value.decode() if value is not None else None


def _float(raw: dict[bytes, bytes], name: str) -> float | None:
    value = raw.get(name.encode())
    return float(value) if value not in (None, b"") else None


def _chunks(raw: dict[bytes, bytes], name: str) -> list | None:
    value = raw.get(name.encode())
    return unpack_list_chunks(value) if value is not None else None


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
    batch_n: int | None = None  # a batch item: how many choices its line has
    batch_line: str | None = None  # a batch item: its input line
    custom_id: str | None = None
    stream: str | None = None  # a routed request's stream (None: its partition's, Keys.stream_for)
    prompt_logprobs: list | None = None  # set with the first token, when the request asked for them
    prompt_top_logprobs: int | None = None  # vLLM's prompt_logprobs as asked (written by the gateway)
    echo: list | None = None  # [prompt text, prompt only] of a completion with echo (the gateway's)
    embedding: str | None = None  # an embedding request's vector, base64 float32 (the scheduler's)

    @classmethod
    def parse(cls, req_id: str, raw: dict[bytes, bytes]):
        if not raw:
            return None
        state = _text(raw, F.STATE) or "queued"
        top = _text(raw, F.TOP_LOGPROBS)
        usage, error, batch_n = raw.get(F.USAGE.encode()), raw.get(F.ERROR.encode()), _text(raw, F.BATCH_N)
        prompt_top, echo = _text(raw, F.PROMPT_TOP_LOGPROBS), raw.get(F.ECHO.encode())
        return cls(
            req_id=req_id, state=state if state in REQUEST_STATES else "queued",
            seq=int(raw.get(F.SEQ.encode(), 0)), token_ids=_chunks(raw, F.TOKEN_IDS) or [],
            text=_text(raw, F.TEXT) or "", logprobs=_chunks(raw, F.LOGPROBS), offsets=_chunks(raw, F.OFFSETS),
            finish_reason=_text(raw, F.FINISH_REASON) or None,
            usage=json.loads(usage) if usage is not None else None,
            error=json.loads(error) if error is not None else None,
            owner=_text(raw, F.OWNER), model=_text(raw, F.MODEL), api=_text(raw, F.API),
            top_logprobs=int(top) if top not in (None, "") else None,
            tool_format=_text(raw, F.TOOL_FORMAT) or None,
            parallel_tool_calls=_text(raw, F.PARALLEL_TOOL_CALLS) != "0",
            prompt_tokens=int(raw.get(F.PROMPT_TOKENS.encode(), 0)),
            queued_at=_float(raw, F.QUEUED_AT), started_at=_float(raw, F.STARTED_AT),
            first_token_at=_float(raw, F.FIRST_TOKEN_AT), finished_at=_float(raw, F.FINISHED_AT),
            deadline=_float(raw, F.DEADLINE), entry_id=_text(raw, F.ENTRY_ID), tenant=_text(raw, F.TENANT),
            batch_n=int(batch_n) if batch_n else None, batch_line=_text(raw, F.BATCH_LINE),
            custom_id=_text(raw, F.CUSTOM_ID) or None, stream=_text(raw, F.STREAM),
            prompt_logprobs=_chunks(raw, F.PROMPT_LOGPROBS),
            prompt_top_logprobs=int(prompt_top) if prompt_top else None,
            echo=json.loads(echo) if echo is not None else None,
            embedding=_text(raw, F.EMBEDDING),
        )

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def is_refused(self) -> bool:
        """Failed because the scheduler refused the input itself (a client's 400, not a fault)."""
        return (self.state == RequestState.FAILED.value and self.error is not None
                and self.error.get("code") == ErrorCode.INVALID_REQUEST.value)


@dataclass
class StoredProgress:
    """What a previous owner already delivered: where a successor resumes."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    seq: int = 0
    offsets: list = field(default_factory=list)  # per event: [num_tokens, num_chars] so far
    state: str | None = None
    owner: str | None = None

    @classmethod
    def parse(cls, raw: dict[bytes, bytes]) -> StoredProgress:
        progress = cls()
        if raw:
            progress.token_ids = _chunks(raw, F.TOKEN_IDS) or []
            progress.text = _text(raw, F.TEXT) or ""
            progress.offsets = _chunks(raw, F.OFFSETS) or []
            progress.seq = int(raw.get(F.SEQ.encode(), b"0"))
            progress.state, progress.owner = _text(raw, F.STATE), _text(raw, F.OWNER)
        return progress


def parse_progress_row(row: list) -> tuple[str | None, int, str | None, float | None]:
    """An HMGET of PROGRESS_FIELDS: (state, seq, owner, deadline)."""
    state, seq, owner, deadline = row
    return (state.decode() if state else None, int(seq or 0), owner.decode() if owner else None,
            float(deadline) if deadline else None)


def parse_timing_row(row: list) -> tuple[float | None, float | None]:
    """An HMGET of TIMING_FIELDS: (queued_at, started_at)."""
    return tuple(float(v) if v else None for v in row)
