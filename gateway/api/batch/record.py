"""A batch job's record (`tf:batch:{job}`) read back, and the OpenAI Batch object it shows.

Anything may be in that hash: a field written by hand or by an older version, a value that is
not JSON where JSON belongs, bytes that are not text. Reading it never fails: a record with a
bad field shows as a `failed` job whose errors name each bad field (code `corrupt_record`), so
that one such record cannot take a listing, the status page or `tokenfleet status` down.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from gateway.api.batch.entry import check_metadata
from protocol.keys import JOB_ID_PATTERN

TERMINAL_JOB_STATES = ("completed", "failed", "cancelled", "expired")
JOB_STATES = ("validating", "in_progress", "finalizing", "cancelling", *TERMINAL_JOB_STATES)
REQUIRED_FIELDS = ("status", "created_at")  # every writer of a record sets both in its first step
COUNT_FIELDS = ("total", "completed", "failed")
TIME_FIELDS = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
               "expired_at", "cancelling_at", "cancelled_at")


def output_file_id(job_id: str) -> str:
    return f"file-{job_id}-output"


def error_file_id(job_id: str) -> str:
    return f"file-{job_id}-errors"


@dataclass
class Job:
    """A parsed tf:batch:{job} hash."""

    id: str
    fields: dict[str, str]
    problems: dict[str, str] = field(default_factory=dict)  # field -> what is wrong with its stored value

    @classmethod
    def parse(cls, job_id: str, raw: dict[bytes, bytes]) -> Job | None:
        if not raw:
            return None
        fields: dict[str, str] = {}
        problems: dict[str, str] = {}
        for raw_name, raw_value in raw.items():
            name, name_ok = _decoded(raw_name)
            fields[name], value_ok = _decoded(raw_value)
            if not name_ok:
                problems[name] = "has a name that is not UTF-8 text"
            elif not value_ok:
                problems[name] = "is not UTF-8 text"
        if not re.match(JOB_ID_PATTERN, job_id):
            problems["id"] = f"{job_id[:80]!r} is not a job id (it must match {JOB_ID_PATTERN})"
        return cls(job_id, fields, problems)

    # The ingester's view: the fields as the atomic steps wrote them.

    def _int(self, name: str) -> int:
        return int(self.fields.get(name) or 0)

    @property
    def status(self) -> str:
        return self.fields.get("status", "validating")

    @property
    def ending(self) -> str | None:
        return self.fields.get("ending")

    @property
    def model(self) -> str | None:
        return self.fields.get("model") or None

    @property
    def total(self) -> int:
        return self._int("total")

    @property
    def next_index(self) -> int:
        return self._int("next_index")

    @property
    def num_written(self) -> int:
        return self._int("completed") + self._int("failed")

    @property
    def in_flight(self) -> int:
        """Lines queued whose output is not written yet."""
        return self.next_index - self.num_written

    @property
    def tenant(self) -> str | None:
        """Whose job (set when a tenant's key created it through /v1/batches)."""
        return self.fields.get("tenant") or None

    @property
    def expires_at(self) -> float | None:
        value = self.fields.get("expires_at")
        return float(value) if value else None

    # What readers show: whatever is stored, never an exception.

    def to_openai(self) -> dict:
        """The OpenAI Batch object; a corrupt record's is `failed`, its errors naming the bad fields."""
        reader = _Reader(self.fields, dict(self.problems))
        status = reader.status()
        counts = {name: reader.count(name) for name in COUNT_FIELDS}
        times = {name: reader.timestamp(name) for name in TIME_FIELDS}
        errors = reader.errors()
        metadata = reader.metadata()
        if reader.problems:
            status = "failed"
            errors = [*(errors or []), *(
                {"code": "corrupt_record", "param": name, "line": None,
                 "message": f"the job's record is corrupt: its field {name!r} {why}"}
                for name, why in sorted(reader.problems.items()))]
        done = status in TERMINAL_JOB_STATES
        return {
            "id": self.id, "object": "batch", "endpoint": self.fields.get("endpoint") or None,
            "model": self.model,
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": self.fields.get("input_file_id") or None,
            "completion_window": self.fields.get("completion_window", "24h"),
            "status": status,
            "output_file_id": output_file_id(self.id) if done and counts["completed"] else None,
            "error_file_id": error_file_id(self.id) if done and counts["failed"] else None,
            **times,
            "request_counts": counts,
            "metadata": metadata,
            "entry_id": self.fields.get("entry_id") or None,
        }


def _decoded(raw: bytes) -> tuple[str, bool]:
    """The text, and whether it was UTF-8 (if not, undecodable bytes show as U+FFFD)."""
    try:
        return raw.decode(), True
    except UnicodeDecodeError:
        return raw.decode(errors="replace"), False


class _Reader:
    """Reads a record's fields leniently, noting in `problems` each one that is not what it should be."""

    def __init__(self, fields: dict[str, str], problems: dict[str, str]) -> None:
        self.fields = fields
        self.problems = problems
        for name in REQUIRED_FIELDS:
            if name not in fields:
                problems.setdefault(name, "is missing")

    def _bad(self, name: str, why: str) -> None:
        self.problems.setdefault(name, why)

    def status(self) -> str:
        value = self.fields.get("status", "validating")
        if value not in JOB_STATES:
            self._bad("status", f"holds {value[:40]!r}, which is not a batch status")
        return value

    def count(self, name: str) -> int:
        value = self.fields.get(name)
        if not value:
            return 0
        try:
            number = int(value)
        except ValueError:
            number = -1
        if number < 0:
            self._bad(name, f"holds {value[:40]!r}, which is not a count")
            return 0
        return number

    def timestamp(self, name: str) -> int | None:
        value = self.fields.get(name)
        if not value:
            return None
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds < 0:
            self._bad(name, f"holds {value[:40]!r}, which is not a time in seconds")
            return None
        return int(seconds)

    def errors(self) -> list[dict] | None:
        """The refusal's errors, each {code, message, param, line} as OpenAI's BatchError."""
        text = self.fields.get("errors")
        if not text:
            return None
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list) or not all(isinstance(e, dict) and isinstance(e.get("message"), str)
                                                  for e in value):
            self._bad("errors", "is not a JSON list of errors with a message each")
            return None
        return [{"code": e.get("code"), "message": e["message"], "param": e.get("param"),
                 "line": e.get("line")} for e in value]

    def metadata(self) -> dict[str, str] | None:
        text = self.fields.get("metadata")
        if not text:
            return None
        try:
            return check_metadata(json.loads(text))
        except ValueError as exc:  # (a JSONDecodeError too)
            self._bad("metadata", f"is not valid metadata ({exc})")
            return None
