"""A batch job that cannot run is refused as a whole, up front where it can be: bad metadata
(OpenAI's rules: an object of at most 16 string keys of up to 64 characters, string values of up
to 512) and lines that are not for the batch's endpoint. POST /v1/batches answers 400 naming the
problem; an entry written straight into `tf:batch:in` becomes a failed job with that reason,
which lists like any other. Real Redis, the gateway's own ingester, no scheduler (nothing runs)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import aiohttp
import pytest
import redis

from tests.gateway.conftest import MODEL

pytestmark = pytest.mark.asyncio
DOCS = Path(__file__).resolve().parents[2] / "docs"


def chat_line(custom_id: str, **changes) -> str:
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}}
    line.update(changes)
    return json.dumps(line)


MISMATCHED = {  # a file whose second line is for another endpoint -> what the refusal names
    "url": ([chat_line("a"), chat_line("b", url="/v1/completions")], ["line 2", "'b'", "/v1/completions"]),
    "body": ([chat_line("a"), chat_line("b", body={"model": MODEL, "prompt": "hi"})], ["line 2", "messages"]),
}


async def _upload(client, lines: list[str]) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", ("\n".join(lines) + "\n").encode(), filename="job.jsonl")
    response = await client.post("/v1/files", data=form)
    assert response.status == 200, await response.text()
    return (await response.json())["id"]


async def _wait_for_status(client, job_id: str, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        response = await client.get(f"/v1/batches/{job_id}")
        if response.status == 200 and (batch := await response.json())["status"] not in ("validating",):
            return batch
        assert time.monotonic() < deadline, (response.status, await response.text())
        await asyncio.sleep(0.1)


@pytest.mark.parametrize(("metadata", "words"), [
    ({"k" * 65: "v"}, ["longer than 64"]),
    ({"k": "v" * 513}, ["'k'", "longer than 512"]),
    ({f"k{i}": "v" for i in range(17)}, ["16"]),
    ({"k": 1}, ["metadata.k"]),
    ("notjson", ["metadata"]),
])
async def test_the_api_refuses_bad_metadata_naming_the_problem(make_client, redis_server, metadata,
                                                               words) -> None:
    client = await make_client()
    file_id = await _upload(client, [chat_line("a")])
    response = await client.post("/v1/batches", json={"input_file_id": file_id, "metadata": metadata,
                                                      "endpoint": "/v1/chat/completions"})
    assert response.status == 400, await response.text()
    error = (await response.json())["error"]
    assert error["param"].startswith("metadata"), error
    for word in words:
        assert word in error["message"] or word == error["param"], error
    assert redis.Redis.from_url(redis_server.url).xlen("tf:batch:in") == 0  # nothing was submitted


@pytest.mark.parametrize("kind", sorted(MISMATCHED))
async def test_the_api_refuses_a_file_with_a_line_for_another_endpoint(make_client, redis_server,
                                                                       kind) -> None:
    lines, words = MISMATCHED[kind]
    client = await make_client()
    file_id = await _upload(client, lines)
    response = await client.post("/v1/batches", json={"input_file_id": file_id,
                                                      "endpoint": "/v1/chat/completions"})
    assert response.status == 400, await response.text()
    error = (await response.json())["error"]
    assert error["code"] == "endpoint_mismatch" and error["param"] == "input_file_id", error
    for word in words:
        assert word in error["message"], error
    assert redis.Redis.from_url(redis_server.url).xlen("tf:batch:in") == 0
    # A line malformed in another way is that line's problem: the batch is accepted.
    file_id = await _upload(client, [chat_line("a"), chat_line("b", body={"messages": [], "frobnicate": 1})])
    response = await client.post("/v1/batches", json={"input_file_id": file_id,
                                                      "endpoint": "/v1/chat/completions"})
    assert response.status == 200, await response.text()


async def test_raw_entries_the_ingester_refuses_list_as_failed_with_their_reasons(make_client,
                                                                                  redis_server) -> None:
    client = await make_client()
    plain = redis.Redis.from_url(redis_server.url)
    good = chat_line("a")
    plain.xadd("tf:batch:in", {"job_id": "bad-metadata", "lines": good, "metadata": "notjson"})
    for kind, (lines, _) in MISMATCHED.items():
        plain.xadd("tf:batch:in", {"job_id": f"mismatch-{kind}", "lines": "\n".join(lines),
                                   "endpoint": "/v1/chat/completions"})
    batch = await _wait_for_status(client, "bad-metadata")
    assert batch["status"] == "failed", batch
    [error] = batch["errors"]["data"]
    assert (error["code"], error["param"]) == ("invalid_metadata", "metadata")
    assert "not JSON" in error["message"]
    assert batch["metadata"] is None  # the refused value is not kept
    for kind, (_, words) in MISMATCHED.items():
        batch = await _wait_for_status(client, f"mismatch-{kind}")
        assert batch["status"] == "failed", batch  # not a completed job with every line failed
        assert batch["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
        [error] = batch["errors"]["data"]
        assert error["code"] == "endpoint_mismatch" and error["line"] == 2, error
        for word in words:
            assert word in error["message"], error
    listing = await client.get("/v1/batches")
    assert listing.status == 200, await listing.text()
    assert {b["id"]: b["status"] for b in (await listing.json())["data"]} == {
        "bad-metadata": "failed", "mismatch-url": "failed", "mismatch-body": "failed"}
    fleet = await client.get("/fleet.json")
    assert fleet.status == 200 and {j["status"] for j in (await fleet.json())["batch_jobs"]} == {"failed"}


async def test_a_raw_entry_without_a_job_id_gets_the_id_docs_batch_md_gives(make_client,
                                                                            redis_server) -> None:
    # The doc's worked example and its rule...
    example = re.search(r"`(\d+-\d+)` becomes `(batch_[A-Za-z0-9_]+)`", (DOCS / "batch.md").read_text())
    assert example is not None, "docs/batch.md shows no example of a default job id"
    entry, named = example.groups()
    assert named == "batch_" + entry.replace("-", "_")
    # ...are what the ingester does, and the id is usable in keys and URLs.
    client = await make_client()
    plain = redis.Redis.from_url(redis_server.url)
    entry_id = plain.xadd("tf:batch:in", {"lines": chat_line("a"), "metadata": '{"team": "evals"}'}).decode()
    job_id = "batch_" + entry_id.replace("-", "_")
    batch = await _wait_for_status(client, job_id)
    assert batch["id"] == job_id and batch["metadata"] == {"team": "evals"}, batch
    assert plain.get(f"tf:batch:entry:{entry_id}") == job_id.encode()
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", job_id)
