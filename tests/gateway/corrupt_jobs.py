"""Batch job records as a hand, an older version or a bug might leave them in Redis: one good
record and, next to it, one corrupt record per way a field can be wrong. Every reader of job
records is tested against these (tests/gateway/test_batch_records.py, tests/tokenfleet/)."""

from __future__ import annotations

import redis

from protocol.keys import Keys

GOOD_ID = "good-1"
GOOD: dict[str, str | bytes] = {
    "id": GOOD_ID, "status": "completed", "created_at": "1700000000.5", "in_progress_at": "1700000001",
    "completed_at": "1700000010", "total": "2", "completed": "2", "failed": "0", "model": "m",
    "endpoint": "/v1/chat/completions", "metadata": '{"team": "evals"}', "entry_id": "1700000000000-0",
}
# job id -> (fields changed from GOOD, None removing one; the field its error must name)
CORRUPT: dict[str, tuple[dict, str]] = {
    "bad-metadata": ({"metadata": "notjson"}, "metadata"),
    "list-metadata": ({"metadata": "[1]"}, "metadata"),
    "number-in-metadata": ({"metadata": '{"n": 1}'}, "metadata"),
    "bad-errors": ({"status": "failed", "errors": "{oops"}, "errors"),
    "errors-of-numbers": ({"status": "failed", "errors": "[1, 2]"}, "errors"),
    "bad-count": ({"total": "lots"}, "total"),
    "negative-count": ({"failed": "-3"}, "failed"),
    "bad-time": ({"created_at": "yesterday"}, "created_at"),
    "infinite-time": ({"completed_at": "inf"}, "completed_at"),
    "bad-status": ({"status": "exploded"}, "status"),
    "no-status": ({"status": None}, "status"),
    "no-created-at": ({"created_at": None}, "created_at"),
    "garbage-metadata": ({"metadata": b"\xff\xfe{"}, "metadata"),
    "garbage-model": ({"model": b"\xc3\x28"}, "model"),
}
KEYS = Keys()
GARBAGE_ID = b"bad\xffid"  # a member of tf:batch:jobs that is not text, with a record of its own


def write_records(client: redis.Redis) -> None:
    """The good record among the corrupt ones in tf:batch:jobs (newest first: all of them in one page)."""
    for rank, (job_id, (changes, _)) in enumerate(CORRUPT.items()):
        fields = {**GOOD, "id": job_id, **changes}
        client.hset(KEYS.batch_job(job_id), mapping={k: v for k, v in fields.items() if v is not None})
        client.zadd("tf:batch:jobs", {job_id: 1000 + rank})
        if rank == len(CORRUPT) // 2:
            client.hset(KEYS.batch_job(GOOD_ID), mapping=GOOD)
            client.zadd("tf:batch:jobs", {GOOD_ID: 1000 + rank + 0.5})
    client.hset(KEYS.batch_job_raw(GARBAGE_ID), mapping={**GOOD, "id": GARBAGE_ID})
    client.zadd("tf:batch:jobs", {GARBAGE_ID: 999})


def check_batches(batches: list[dict]) -> None:
    """OpenAI Batch objects of every record above: the good one intact, each corrupt one failed with
    an error naming its bad field."""
    by_id = {b["id"]: b for b in batches}
    assert len(by_id) == len(CORRUPT) + 2, sorted(by_id)
    good = by_id[GOOD_ID]
    assert good["status"] == "completed" and good["errors"] is None, good
    assert good["metadata"] == {"team": "evals"}
    assert good["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert good["created_at"] == 1700000000
    for job_id, (_, bad_field) in CORRUPT.items():
        batch = by_id[job_id]
        assert batch["status"] == "failed", batch
        corrupt = [e for e in batch["errors"]["data"] if e["code"] == "corrupt_record"]
        assert [e["param"] for e in corrupt] == [bad_field], (job_id, batch["errors"])
        assert repr(bad_field) in corrupt[0]["message"], corrupt
    garbage = next(b for b in batches if "\ufffd" in b["id"])  # (its undecodable byte)
    assert garbage["status"] == "failed" and garbage["errors"]["data"][0]["param"] == "id", garbage


def check_rows(rows: list[dict]) -> None:
    """The status page's (fleet.json) rows of the same records."""
    by_id = {row["id"]: row for row in rows}
    assert by_id[GOOD_ID]["status"] == "completed" and by_id[GOOD_ID]["error"] is None
    assert by_id[GOOD_ID]["progress"] == 1.0
    for job_id, (_, bad_field) in CORRUPT.items():
        assert by_id[job_id]["status"] == "failed", by_id[job_id]
        assert repr(bad_field) in by_id[job_id]["error"], by_id[job_id]
