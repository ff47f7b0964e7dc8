"""The fields of a batch job's entry in `tf:batch:in` (what `/v1/batches` and `tokenfleet batch
submit` write there too), and what each may hold. The three ways in check them alike: the API
and the CLI refuse a bad field before anything is written, the ingester refuses a raw entry's.
"""

from __future__ import annotations

import json
import re

from protocol.keys import TENANT_PATTERN

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")  # a job's endpoint, each line's url
ENTRY_FIELDS = ("job_id", "model", "lines", "input_file_id", "endpoint", "completion_window", "metadata",
                "tenant")
WINDOW_PATTERN = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# OpenAI's limits on a batch's metadata.
METADATA_MAX_KEYS = 16
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512


class JobRefused(Exception):
    """The job cannot run; `error` is what its record's errors say (OpenAI's BatchError)."""

    def __init__(self, code: str, message: str, param: str | None = None, line: int | None = None) -> None:
        super().__init__(message)
        self.error = {"code": code, "message": message, "param": param, "line": line}


def check_entry(fields: dict, text: dict[str, str]) -> float:
    """An entry's own fields (its lines aside: the ingester reads them next); returns the
    completion window in seconds, or raises JobRefused naming the first bad field."""
    unknown = sorted(set(fields) - set(ENTRY_FIELDS))
    if unknown:
        raise JobRefused("unknown_field",
                         f"unknown fields {unknown}; a job entry may have {list(ENTRY_FIELDS)}", unknown[0])
    if "tenant" in text and not re.match(TENANT_PATTERN, text["tenant"]):
        raise JobRefused("invalid_tenant", f"tenant {text['tenant'][:80]!r} must match {TENANT_PATTERN}",
                         "tenant")
    try:
        window = parse_window(text.get("completion_window", "24h"))
    except ValueError as exc:
        raise JobRefused("invalid_completion_window", str(exc), "completion_window") from None
    if "metadata" in text:
        try:
            parse_metadata(text["metadata"])
        except ValueError as exc:
            raise JobRefused("invalid_metadata", str(exc), "metadata") from None
    endpoint = text.get("endpoint")
    if endpoint is not None and endpoint not in URLS:
        raise JobRefused("invalid_endpoint", f"endpoint {endpoint!r} is not one of {list(URLS)}", "endpoint")
    return window


def parse_window(text: str) -> float:
    """"24h" -> seconds; ValueError naming the accepted forms otherwise."""
    match = WINDOW_PATTERN.match(text)
    if match is None:
        raise ValueError(f"completion_window {text!r} is not a duration such as 24h, 90m or 3600s")
    return int(match.group(1)) * WINDOW_UNITS[match.group(2)]


def job_id_for_entry(entry_id: str) -> str:
    """A job submitted without a job_id is named after its entry, so a retried intake finds it:
    `batch_` + the entry id with its `-` as `_` (`1796108693748-0` -> `batch_1796108693748_0`)."""
    return "batch_" + entry_id.replace("-", "_")


def check_metadata(value: object) -> dict[str, str]:
    """The metadata if it is what OpenAI accepts (an object of at most 16 string keys of up to 64
    characters, with string values of up to 512); ValueError naming the problem otherwise."""
    if not isinstance(value, dict):
        raise ValueError(f"metadata must be a JSON object, got {_json_type(value)}")
    if len(value) > METADATA_MAX_KEYS:
        raise ValueError(f"metadata has {len(value)} keys; at most {METADATA_MAX_KEYS} are allowed")
    for key, item in value.items():
        if len(key) > METADATA_MAX_KEY_CHARS:
            raise ValueError(f"metadata key {key[:80]!r} is longer than {METADATA_MAX_KEY_CHARS} characters")
        if not isinstance(item, str):
            raise ValueError(f"metadata[{key!r}] must be a string, got {_json_type(item)}")
        if len(item) > METADATA_MAX_VALUE_CHARS:
            raise ValueError(f"metadata[{key!r}] is longer than {METADATA_MAX_VALUE_CHARS} characters")
    return value


def parse_metadata(text: str) -> dict[str, str]:
    """The metadata field as stored (JSON text), checked; ValueError naming the problem."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"metadata is not JSON ({exc.msg} at column {exc.colno}): {text[:80]!r}") from None
    return check_metadata(value)


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
             int: "a number", float: "a number"}
    return names.get(type(value), type(value).__name__)
