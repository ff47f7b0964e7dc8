"""Server-Sent Events as bytes: one frame per event, and templates for the frames a stream
sends once per token.

A template is a JSON document rendered once through the same `dumps` as every other frame,
with a marker string where a value goes, and cut around the markers. Filling the holes with
the JSON of the values gives, byte for byte, what `dumps` would give for the whole document
(the tests check this), at the cost of encoding one string per token instead of a dict.
"""

from __future__ import annotations

import json
import uuid
from json.encoder import encode_basestring  # json.dumps(str, ensure_ascii=False), in C

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # built once, not per call


def dumps(value: object) -> str:
    """The JSON of every SSE frame and body: compact, UTF-8 as is."""
    return _ENCODER.encode(value)


def frame(data: object, *, event_id: int | None = None, event: str | None = None) -> bytes:
    """One SSE event: `id:` and `event:` lines when given, then `data:` (a str is sent as is)."""
    head = ""
    if event_id is not None:
        head = f"id: {event_id}\n"
    if event is not None:
        head += f"event: {event}\n"
    return f"{head}data: {data if isinstance(data, str) else dumps(data)}\n\n".encode()


def comment(text: str) -> bytes:
    """A comment line, without the blank line that would end an event. The openai SDK's decoder
    keeps the last `id:` across events (as the spec says) and so dispatches a blank line after
    one as an event with empty data, which it then fails to parse as JSON (a keep-alive in a
    stream whose chunks carry ids broke the client); a comment line alone dispatches nothing."""
    return f": {text}\n".encode()


class Template:
    """A frame with holes: make(render) calls render(marker) -> the frame for a document holding
    `marker` where each value goes; fill(*json_values) puts the values' JSON text in the holes."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts  # the frame's bytes around the holes: len(parts) == holes + 1

    @classmethod
    def make(cls, render, num_holes: int = 1) -> Template | None:
        """None when a marker does not come out once and as is (it cannot, short of a model name
        holding it): the caller then builds the frame the plain way."""
        markers = [f"@hole{i}-{uuid.uuid4().hex}@" for i in range(num_holes)]
        text = render(*markers).decode()
        parts = []
        for marker in markers:
            quoted = f'"{marker}"'
            before, found, text = text.partition(quoted)
            if not found or quoted in text:
                return None
            parts.append(before.encode())
        parts.append(text.encode())
        return cls(parts)

    def fill(self, *values: str) -> bytes:
        """values: JSON text (e.g. encode_basestring(s)), one per hole, in order."""
        parts = self.parts
        if len(parts) == 2:  # the per-token case
            return parts[0] + values[0].encode() + parts[1]
        out = [parts[0]]
        for value, part in zip(values, parts[1:], strict=True):
            out.append(value.encode())
            out.append(part)
        return b"".join(out)


__all__ = ["Template", "comment", "dumps", "encode_basestring", "frame"]
