"""The messages that cross Redis, and their msgpack encoding.

Every message carries a version `v`. Decoding is strict: a field we do not know, a missing
field, a wrong type or another version raises MessageDecodeError, so a poison entry is
recognised as such instead of half-understood.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field

import msgpack

from shared.pooling_params import POOLING_SAMPLING, PoolingParams
from shared.sampling import SamplingParams

WIRE_VERSION = 1

# A request's state in tf:res:{id}; the last four are terminal.
TERMINAL_STATES = ("completed", "failed", "cancelled", "expired")
REQUEST_STATES = ("queued", "running", *TERMINAL_STATES)


class MessageDecodeError(ValueError):
    """Bytes that are not a message of the expected type and version."""


def pack_list_chunk(items: list) -> bytes:
    """One chunk of a growing list field of tf:res (token_ids, offsets, logprobs): a scheduler
    appends a chunk per step instead of rewriting the whole list, so what is packed and sent
    per step is the step's own output (Redis still copies the field to extend it)."""
    return msgpack.packb(items, use_bin_type=True)


def unpack_list_chunks(data: bytes) -> list:
    """A list field of tf:res: its chunks, concatenated (one whole list is one chunk)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True)
    unpacker.feed(data)
    items: list = []
    for chunk in unpacker:
        if not isinstance(chunk, list):
            raise MessageDecodeError(f"a list field holds a {type(chunk).__name__}")
        items += chunk
    return items


def _check_type(value: object, annotation: object, name: str) -> None:
    # Fast paths for what every token event carries (this runs once per event per stream).
    if annotation is str or annotation is int:
        if type(value) is annotation:
            return
    elif annotation == list[int] and type(value) is list and all(type(x) is int for x in value):
        return
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        for option in options:
            try:
                _check_type(value, option, name)
                return
            except MessageDecodeError:
                continue
        raise MessageDecodeError(f"field {name!r}: {value!r} is none of {options}")
    if annotation is type(None):
        ok = value is None
    elif annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif annotation is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif origin is list:
        (item,) = typing.get_args(annotation) or (object,)
        if not isinstance(value, list):
            raise MessageDecodeError(f"field {name!r}: expected a list, got {type(value).__name__}")
        for element in value:
            _check_type(element, item, name)
        return
    elif origin is dict or annotation is dict:
        ok = isinstance(value, dict)
    elif annotation is object:
        ok = True
    else:
        ok = isinstance(value, annotation)
    if not ok:
        raise MessageDecodeError(f"field {name!r}: expected {annotation}, got {value!r}")


@functools.cache
def _type_hints(cls: type) -> dict[str, object]:
    """Resolved once per class: resolving them is most of the cost of a decode."""
    return typing.get_type_hints(cls)


@functools.cache
def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _unpack(data: bytes) -> dict:
    """msgpack bytes -> the message's map, without its version (checked here)."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MessageDecodeError(f"not msgpack: {exc}") from None
    if not isinstance(raw, dict):
        raise MessageDecodeError(f"expected a map, got {type(raw).__name__}")
    version = raw.pop("v", None)
    if version != WIRE_VERSION:
        raise MessageDecodeError(f"wire version {version!r}, this build speaks {WIRE_VERSION}")
    return raw


class _Message:
    """Mixin: `encode()` to msgpack bytes, `decode(bytes)` back, strictly."""

    def encode(self) -> bytes:
        # Shallow: the fields are plain values and lists (asdict would deep-copy them per event).
        fields = {name: getattr(self, name) for name in _fields(type(self))}
        return msgpack.packb({"v": WIRE_VERSION, **fields}, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes):
        return cls.from_map(_unpack(data))

    @classmethod
    def from_map(cls, raw: dict):
        """Build from an unpacked map (its `v` already checked), strictly."""
        hints = _type_hints(cls)
        fields = _fields(cls)
        unknown = set(raw) - set(fields)
        if unknown:
            raise MessageDecodeError(f"unknown fields {sorted(unknown)} in {cls.__name__}")
        for name, f in fields.items():
            if name in raw:
                _check_type(raw[name], hints[name], name)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise MessageDecodeError(f"{cls.__name__} lacks the field {name!r}")
        return cls(**raw)


@dataclass
class RequestMessage(_Message):
    """One generation request, as the gateway (or batch ingester) queues it."""

    req_id: str  # server-made
    model: str
    prompt_token_ids: list[int]
    sampling: dict  # SamplingParams fields; see sampling_params()
    kind: str = "interactive"  # or "batch"
    priority: int = 0  # lower number first
    arrival_time: float = 0.0  # unix seconds
    deadline: float | None = None  # unix seconds; expires if still queued after it
    batch_job_id: str | None = None
    custom_id: str | None = None
    tenant: str | None = None  # whose request (from the API key); schedulers share out slots by it
    lora_name: str | None = None  # the LoRA adapter it runs with (protocol/lora_registry.py); None: the base
    # PoolingParams fields: an embedding request, for a --runner pooling scheduler (its sampling
    # is then POOLING_SAMPLING's); None: text generation.
    pooling: dict | None = None

    def pooling_params(self) -> PoolingParams | None:
        """The embedding request's parameters (None: a generation request)."""
        if self.pooling is None:
            return None
        known = {f.name for f in dataclasses.fields(PoolingParams)}
        unknown = set(self.pooling) - known
        if unknown:
            raise MessageDecodeError(f"unknown pooling fields {sorted(unknown)}")
        return PoolingParams(**self.pooling)

    def sampling_params(self) -> SamplingParams:
        """The validated sampling parameters (raises InvalidRequestError naming a bad one)."""
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = set(self.sampling) - known
        if unknown:
            raise MessageDecodeError(f"unknown sampling fields {sorted(unknown)}")
        return SamplingParams(**self.sampling).validate()

    @classmethod
    def make(cls, req_id: str, model: str, prompt_token_ids: list[int], sampling: SamplingParams,
             **kwargs) -> RequestMessage:
        return cls(req_id, model, list(prompt_token_ids), dataclasses.asdict(sampling), **kwargs)

    @classmethod
    def make_embedding(cls, req_id: str, model: str, prompt_token_ids: list[int], pooling: PoolingParams,
                       **kwargs) -> RequestMessage:
        """An embedding request (its one-token sampling is the pooling runner's)."""
        return cls(req_id, model, list(prompt_token_ids), dataclasses.asdict(POOLING_SAMPLING),
                   pooling=dataclasses.asdict(pooling), **kwargs)


@dataclass
class TokenEvent(_Message):
    """New tokens of one request; the last event carries finish_reason and usage."""

    req_id: str
    seq: int  # 1, 2, 3...: a client resumes after the last seq it saw
    token_ids: list[int]
    text: str
    logprobs: list | None = None  # per token: [token_id, logprob, [[id, logprob], ...] | None]
    finish_reason: str | None = None
    usage: dict | None = None
    type: str = "token"
    # On the first token's event, when the request asked for them: per prompt token
    # [token_id, logprob | None, [[id, logprob], ...] | None], the first one's logprob None.
    prompt_logprobs: list | None = None


@dataclass
class ErrorEvent(_Message):
    req_id: str
    seq: int
    code: str  # e.g. "invalid_request", "expired", "dead_letter"
    message: str
    type: str = "error"


_PLAIN_TOKEN_FIELDS = frozenset(f.name for f in dataclasses.fields(TokenEvent))


def _is_plain_token_event(raw: dict) -> bool:
    """The event of almost every step (all fields, no logprobs, not the last): the same checks
    as from_map, written out, because this runs once per token per stream."""
    ids = raw.get("token_ids")
    return (raw.keys() == _PLAIN_TOKEN_FIELDS and raw["type"] == "token" and raw["logprobs"] is None
            and raw["prompt_logprobs"] is None and raw["finish_reason"] is None and raw["usage"] is None
            and type(raw["req_id"]) is str
            and type(raw["seq"]) is int and type(raw["text"]) is str and type(ids) is list
            and all(type(token) is int for token in ids))


def decode_event(data: bytes) -> TokenEvent | ErrorEvent:
    """A token or error event, by its `type` field; unpacked once (this runs per token)."""
    raw = _unpack(data)
    if _is_plain_token_event(raw):
        return TokenEvent(**raw)
    return (ErrorEvent if raw.get("type") == "error" else TokenEvent).from_map(raw)


@dataclass
class DeadLetter(_Message):
    """Why an entry of a request stream was set aside in tf:dead."""

    stream: str
    entry_id: str
    reason: str
    num_deliveries: int
    req_id: str | None = None
    payload: bytes = field(default=b"")
