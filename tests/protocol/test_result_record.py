"""The record's builders and parser agree, and a refusal travels as an error code, not a prefix."""

from __future__ import annotations

import pytest

from gateway.api.openai.api import _raise_for
from gateway.api.openai.format import ChoiceOutput
from gateway.errors import BadRequest, UpstreamFailed
from protocol.messages import pack_list_chunk
from protocol.result_record import (
    ErrorCode,
    ResultRecord,
    StoredProgress,
    progress_fields,
    queued_fields,
    step_appends,
    terminal_fields,
)


def _hash(*parts: dict) -> dict[bytes, bytes]:
    """Fields as Redis hands them back (bytes; appends concatenated)."""
    raw: dict[bytes, bytes] = {}
    for part in parts:
        for name, value in part.items():
            value = value if isinstance(value, bytes) else str(value).encode()
            raw[name.encode()] = raw.get(name.encode(), b"") + value if name in ("text", "offsets") else value
    return raw


def test_what_the_writers_build_the_parser_reads():
    queued = queued_fields(model="m", api="chat", queued_at=1.5, prompt_tokens=3, top_logprobs=2,
                           batch=("job", 4, 2, '{"x": 1}', "c-1"))
    done = terminal_fields("failed", error_code=ErrorCode.INVALID_REQUEST, error_message="bad schema", seq=1)
    record = ResultRecord.parse("r", _hash(queued, progress_fields(1, "hi", pack_list_chunk([7]),
                                                                   pack_list_chunk([[1, 2]])), done))
    assert (record.state, record.model, record.api, record.top_logprobs, record.batch_n) == (
        "failed", "m", "chat", 2, 2)
    assert (record.batch_line, record.custom_id) == ('{"x": 1}', "c-1")
    assert (record.token_ids, record.text) == ([7], "hi")
    assert record.error == {"code": "invalid_request", "message": "bad schema"}
    assert record.is_refused
    progress = StoredProgress.parse(_hash(queued, step_appends(pack_list_chunk([[1, 2]]), text="hi")))
    assert (progress.state, progress.text, progress.offsets, progress.seq) == ("queued", "hi", [[1, 2]], 0)


def test_a_refused_input_is_a_400_and_any_other_failure_is_not():
    refused = ChoiceOutput(0, state="failed", error={"code": "invalid_request", "message": "bad schema"})
    with pytest.raises(BadRequest, match="^bad schema$"):
        _raise_for([refused])
    # A message that merely reads like the old prefix is no refusal.
    dead = ChoiceOutput(0, state="failed", error={"code": "dead_letter", "message": "invalid: 5 times"})
    with pytest.raises(UpstreamFailed):
        _raise_for([dead])
