"""JobStore.collect against a real Redis: a notice batch's lines written by a few script calls
(more lines than one call takes), each line once however often it comes again (a successor
redoing a dead ingester's notices), its records deleted only by the call that wrote it, and the
job moved to finalizing by the call that wrote its last line."""

from __future__ import annotations

import json

import pytest
import redis
import redis.asyncio as aioredis

from gateway.api.batch.jobs import COLLECT_CHUNK, JobStore, LineOutput, item_req_id
from protocol.keys import Keys

pytestmark = pytest.mark.asyncio
JOB = "batch_collect0"
NUM_LINES = COLLECT_CHUNK * 2 + 5  # three calls' worth


def _outputs(keys: Keys, indexes: list[int], choices: int = 2) -> list[LineOutput]:
    return [LineOutput(i, f"c{i}", i % 7 != 3, json.dumps({"custom_id": f"c{i}", "n": i}),
                       [keys.result(item_req_id(JOB, i, c)) for c in range(choices)]) for i in indexes]


async def test_each_line_is_written_once_and_the_last_one_finalizes_the_job(redis_server) -> None:
    keys = Keys()
    plain = redis.Redis.from_url(redis_server.url)
    plain.hset(keys.batch_job(JOB), mapping={"total": NUM_LINES, "next_index": NUM_LINES, "completed": 0,
                                             "failed": 0, "status": "in_progress"})
    for i in range(NUM_LINES):
        for c in range(2):
            plain.hset(keys.result(item_req_id(JOB, i, c)), mapping={"state": "completed"})
    client = aioredis.Redis.from_url(redis_server.url)
    store = JobStore(client, keys)
    try:
        first = list(range(0, NUM_LINES - 1, 2))  # every other line but the last
        written, finished = await store.collect(JOB, _outputs(keys, first))
        assert written == [True] * len(first) and not finished
        assert not plain.exists(*(keys.result(item_req_id(JOB, i, c)) for i in first for c in range(2)))

        plain.hset(keys.result(item_req_id(JOB, 0, 0)), mapping={"state": "completed"})  # (a stray copy)
        again = list(range(NUM_LINES))  # a redo of the first lines with all the others
        written, finished = await store.collect(JOB, _outputs(keys, again))
        assert written == [i not in first for i in again] and finished
        assert plain.exists(keys.result(item_req_id(JOB, 0, 0))), "a line written before deletes nothing"
        assert not plain.exists(*(keys.result(item_req_id(JOB, i, c)) for i in range(1, NUM_LINES, 2)
                                  for c in range(2)))

        entries = plain.xrange(keys.batch_out(JOB))
        assert sorted(int(f[b"index"]) for _, f in entries) == list(range(NUM_LINES)), "every line once"
        for _, f in entries:
            i = int(f[b"index"])
            assert f[b"custom_id"] == f"c{i}".encode() and f[b"ok"] == (b"0" if i % 7 == 3 else b"1")
            assert json.loads(f[b"line"]) == {"custom_id": f"c{i}", "n": i}
        job = {k.decode(): v.decode() for k, v in plain.hgetall(keys.batch_job(JOB)).items()}
        num_failed = sum(1 for i in range(NUM_LINES) if i % 7 == 3)
        assert (int(job["completed"]), int(job["failed"])) == (NUM_LINES - num_failed, num_failed)
        assert job["status"] == "finalizing"

        written, finished = await store.collect(JOB, _outputs(keys, [5]))  # after the end: nothing
        assert written == [False] and not finished
    finally:
        await client.aclose()
