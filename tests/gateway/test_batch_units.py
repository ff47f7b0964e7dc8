"""The pure parts of batch jobs: line checks, output lines, ids, windows, the written bitmap."""

from __future__ import annotations

import json

import pytest

from gateway.api.batch.entry import check_metadata, job_id_for_entry, parse_metadata, parse_window
from gateway.api.batch.jobs import item_req_id, parse_item_req_id, unwritten
from gateway.api.batch.lines import (
    LineItem,
    check_lines,
    endpoint_mismatch,
    error_line,
    output_line,
    refused_line,
    split_lines,
)
from gateway.errors import BadRequest

CHAT = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}}


def line(**changes) -> str:
    data = json.loads(json.dumps(CHAT))
    for key, value in changes.items():
        if key.startswith("body_"):
            data["body"][key[5:]] = value
        else:
            data[key] = value
    return json.dumps(data)


def test_check_lines_names_each_problem_and_settles_the_model() -> None:
    raws = [line(), line(custom_id="b", url="/v1/completions", body={"prompt": "x"}), "{not json",
            "[1, 2]", line(custom_id="a"), line(custom_id="c", method="GET"), line(custom_id="d", extra=1),
            line(custom_id="e", body_stream=True), line(custom_id="f", body_model="other"),
            line(custom_id="g", body_temperature="hot")]
    items, model = check_lines(raws, model=None)
    assert model == "m"  # the first valid line's
    errors = {item.index: item.error for item in items if item.error}
    assert sorted(errors) == [2, 3, 4, 5, 6, 7, 8, 9]
    assert "not valid JSON" in errors[2]["message"] and errors[2]["status_code"] == 400
    assert "JSON object" in errors[3]["message"]
    assert errors[4]["code"] == "duplicate_custom_id"
    assert errors[5]["param"] == "method"
    assert errors[6]["param"] == "extra"
    assert errors[7]["param"] == "body.stream"
    assert errors[8]["code"] == "model_mismatch"
    assert errors[9]["param"] == "body.temperature"
    assert [item.custom_id for item in items[:3]] == ["a", "b", None]


def test_the_first_line_for_another_endpoint_is_named_with_its_number_in_the_file() -> None:
    chat = "/v1/chat/completions"
    other_url = line(custom_id="b", url="/v1/completions", body={"prompt": "x"})
    text = "\n".join([line(), "", other_url, line(custom_id="c", body={"prompt": "x"})])
    mismatch = endpoint_mismatch(text, chat)
    assert (mismatch.line, mismatch.param) == (3, "url")  # the blank line counts, as in an editor
    assert "line 3 (custom_id 'b')" in mismatch.message and "/v1/completions" in mismatch.message
    mismatch = endpoint_mismatch("\n".join([line(), line(custom_id="c", body={"prompt": "x"})]), chat)
    assert (mismatch.line, mismatch.param) == (2, "body.messages")
    assert endpoint_mismatch(other_url, "/v1/completions") is None
    # Lines malformed otherwise are their own problem, not the job's.
    for fine in ("{not json", "[1]", line(custom_id="d", extra=1), line(custom_id="e", body="text")):
        assert endpoint_mismatch("\n".join([line(), fine]), chat) is None, fine


def test_metadata_follows_openais_limits() -> None:
    assert check_metadata({"k" * 64: "v" * 512, **{f"k{i}": "" for i in range(15)}})
    for bad, words in (([1], "object"), ({"k" * 65: "v"}, "64"), ({"k": "v" * 513}, "512"),
                       ({f"k{i}": "v" for i in range(17)}, "16"), ({"k": 1}, "'k'"), ({"k": None}, "null")):
        with pytest.raises(ValueError, match=words):
            check_metadata(bad)
    with pytest.raises(ValueError, match="not JSON"):
        parse_metadata("notjson")


def test_line_items_round_trip_and_blank_lines_are_not_lines() -> None:
    item = LineItem(7, line(), "a", {"status_code": 400, "code": "x", "message": "m", "param": None})
    assert LineItem.unpack(item.pack()) == item
    assert split_lines("a\n\n  \nb\r\nc\n") == ["a", "b", "c"]


def test_output_lines_have_openais_batch_shape() -> None:
    ok = json.loads(output_line("a", "job.0.0", {"object": "chat.completion"}))
    assert ok == {"id": "batch_req_job.0.0", "custom_id": "a", "error": None,
                  "response": {"status_code": 200, "request_id": "job.0.0",
                               "body": {"object": "chat.completion"}}}
    refused = json.loads(refused_line("b", "job.1.0", {"status_code": 400, "code": "c", "message": "m",
                                                      "param": "p"}))
    assert refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"] == {"message": "m", "type": "invalid_request_error",
                                                    "param": "p", "code": "c"}
    failed = json.loads(error_line(None, "job.2.0", "batch_expired", "late"))
    assert failed["response"] is None and failed["error"] == {"code": "batch_expired", "message": "late"}


def test_ids_windows_and_the_written_bitmap() -> None:
    assert parse_item_req_id(item_req_id("batch_x-1", 12, 3)) == ("batch_x-1", 12, 3)
    assert job_id_for_entry("1700000000000-5") == "batch_1700000000000_5"
    assert [parse_window(w) for w in ("24h", "90m", "3600s", "2d")] == [86400, 5400, 3600, 172800]
    for bad in ("soon", "0h", "24", "-1h", "1.5h"):
        with pytest.raises(ValueError, match="completion_window"):
            parse_window(bad)
    assert unwritten(bytes([0b10100000, 0xFF]), 12) == [1, 3, 4, 5, 6, 7]
    assert unwritten(b"", 3) == [0, 1, 2]
    assert unwritten(bytes([0xFF]), 10) == [8, 9]


def test_a_refusal_keeps_the_rest_routes_error_type() -> None:
    from gateway.api.batch.lines import refusal_of

    refusal = refusal_of(BadRequest("too long", param="messages", code="context_length_exceeded"))
    assert refusal == {"status_code": 400, "code": "context_length_exceeded", "message": "too long",
                       "param": "messages", "type": "invalid_request_error"}
