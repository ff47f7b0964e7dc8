"""response_format and tool schemas -> grammar specs (shared/sampling.py), checked here so that
a schema no grammar can enforce is a 400 naming it, before anything is queued.

xgrammar compiles the schema here without the vocabulary (cheap); the scheduler compiles it
again against its model's vocabulary (scheduler/grammar.py), with a cache per schema.
"""

from __future__ import annotations

import functools
import json

from gateway.errors import BadRequest
from scheduler.grammar import compile_error_message


def check_schema(schema: object, param: str, *, strict: bool = True) -> None:
    """Raise BadRequest naming `param` when `schema` is not a JSON schema we can enforce."""
    if not isinstance(schema, dict):
        raise BadRequest(f"{param} must be a JSON schema object", param=param)
    reason = _schema_error(json.dumps(schema, sort_keys=True), strict)
    if reason is not None:
        raise BadRequest(f"{param} is not a JSON schema this server can enforce: {reason}", param=param)


@functools.lru_cache(maxsize=256)
def _schema_error(schema: str, strict: bool) -> str | None:
    """Why xgrammar cannot compile the schema, or None; cached, as clients resend the same schemas."""
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError, TypeError...
        return compile_error_message(exc)
    return None


def response_format_grammar(response_format) -> str | None:
    """The grammar spec of a chat request's response_format (None for plain text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return json.dumps({"type": "json_object"})
    spec = response_format.json_schema
    schema = spec.schema_ if spec.schema_ is not None else {"type": "object"}
    # Omitted means strict, as vLLM (xgrammar's default): the keys the schema names and no
    # others unless it allows them; `strict: false` reads the schema as JSON Schema does.
    strict = spec.strict is not False
    check_schema(schema, "response_format.json_schema.schema", strict=strict)
    return json.dumps({"type": "json_schema", "schema": schema, "strict": strict})
