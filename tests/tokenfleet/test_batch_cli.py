"""`tokenfleet batch submit` refuses, in one line naming the problem and before anything is
written, a job the ingester would fail as a whole; `tokenfleet batch status` shows a corrupt
record (tests/gateway/corrupt_jobs.py) as a failed job naming the bad field. Real Redis."""

from __future__ import annotations

import json

import pytest
import redis

from tests.gateway.corrupt_jobs import CORRUPT, GOOD_ID, write_records
from tokenfleet.cli import main

CHAT = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}}
COMPLETION = {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}


def _one_error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tokenfleet: error:"), lines
    return lines[0]


@pytest.mark.parametrize(("flags", "words"), [
    (["--metadata", "notjson"], ["metadata", "not JSON"]),
    (["--metadata", "[1, 2]"], ["metadata must be a JSON object"]),
    (["--metadata", json.dumps({"k": "v" * 513})], ["metadata['k']", "512"]),
    (["--metadata", json.dumps({"k" * 65: "v"})], ["metadata key", "64"]),
    (["--completion-window", "soon"], ["completion_window 'soon'"]),
    (["--endpoint", "/v1/moderations"], ["endpoint '/v1/moderations'"]),
    (["--endpoint", "/v1/chat/completions"], ["line 2", "custom_id 'b'", "/v1/completions", "--endpoint"]),
])
def test_submit_refuses_a_job_that_cannot_run_in_one_line(redis_server, tmp_path, capsys, flags,
                                                          words) -> None:
    source = tmp_path / "job.jsonl"
    source.write_text(json.dumps(CHAT) + "\n" + json.dumps(COMPLETION) + "\n")
    assert main(["batch", "submit", str(source), "--redis-url", redis_server.url, *flags]) == 1
    error = _one_error_line(capsys)
    for word in words:
        assert word in error, error
    plain = redis.Redis.from_url(redis_server.url)
    assert plain.xlen("tf:batch:in") == 0 and plain.zcard("tf:batch:jobs") == 0  # nothing was submitted


def test_submit_takes_metadata_within_the_limits(redis_server, tmp_path, capsys) -> None:
    source = tmp_path / "job.jsonl"
    source.write_text(json.dumps(CHAT) + "\n")
    metadata = json.dumps({"k" * 64: "v" * 512})
    assert main(["batch", "submit", str(source), "--redis-url", redis_server.url, "--metadata", metadata,
                 "--endpoint", "/v1/chat/completions", "--job-id", "ok-1"]) == 0
    assert capsys.readouterr().out.strip() == "ok-1"
    assert redis.Redis.from_url(redis_server.url).xlen("tf:batch:in") == 1


def test_batch_status_shows_a_corrupt_record_as_failed_naming_the_field(redis_server, capsys) -> None:
    write_records(redis.Redis.from_url(redis_server.url))
    assert main(["batch", "status", GOOD_ID, "--redis-url", redis_server.url]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "completed"
    for job_id, (_, bad_field) in CORRUPT.items():
        assert main(["batch", "status", job_id, "--redis-url", redis_server.url]) == 0, job_id
        batch = json.loads(capsys.readouterr().out)
        assert batch["status"] == "failed" and batch["errors"]["data"][-1]["param"] == bad_field, batch
