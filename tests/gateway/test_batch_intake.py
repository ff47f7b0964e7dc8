"""An intake's staging is fenced: when another ingester takes an entry over (the first one's
claim lapsed, e.g. its event loop was busy), the first stages and commits nothing more, so two
intakes of one job never interleave their lines."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from gateway.api.batch.jobs import IntakeLost, JobStore
from protocol.keys import Keys

pytestmark = pytest.mark.asyncio


async def test_an_intake_taken_over_stages_and_commits_nothing_more(redis_server) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    jobs = JobStore(client, Keys())
    try:
        assert await jobs.begin("job1", "1-0", {}, "first") is None
        await jobs.stage("job1", [b"a", b"b"], "first", chunk=1)
        existing = await jobs.begin("job1", "1-0", {}, "second")  # the takeover
        assert existing is not None and existing.status == "validating"
        with pytest.raises(IntakeLost):
            await jobs.stage("job1", [b"c"], "first")
        with pytest.raises(IntakeLost):
            await jobs.commit("job1", "1-0", 3, 0.0, "first")
        await jobs.stage("job1", [b"x", b"y", b"z"], "second", chunk=2)  # starts the list over
        assert await jobs.commit("job1", "1-0", 3, 0.0, "second")
        assert await client.lrange(Keys().batch_lines("job1"), 0, -1) == [b"x", b"y", b"z"]
        assert not await jobs.commit("job1", "1-0", 3, 0.0, "first")  # committed: acknowledges only
    finally:
        await client.aclose()
