"""No stored value can make a listing fail: corrupt batch job records (bad JSON in a field,
missing fields, wrong types, bytes that are not text), written straight into a real Redis next
to a good one, list as failed jobs whose errors name the bad field; the good one lists as it is.
The CLI's readers (`tokenfleet status`, `tokenfleet batch status`) are in tests/tokenfleet/."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio as aioredis

from gateway.api.batch.jobs import JobStore
from gateway.api.ops.fleet_view import collect_fleet_view
from protocol.keys import Keys
from tests.gateway.corrupt_jobs import CORRUPT, GOOD_ID, check_batches, check_rows, write_records

pytestmark = pytest.mark.asyncio


@pytest.fixture
def records(redis_server):
    write_records(redis.Redis.from_url(redis_server.url))
    return redis_server


async def test_the_job_store_lists_and_gets_corrupt_records_as_failed(records) -> None:
    client = aioredis.Redis.from_url(records.url)
    try:
        store = JobStore(client, Keys())
        jobs, has_more = await store.list(limit=100)
        assert not has_more
        check_batches([job.to_openai() for job in jobs])
        for job_id in [GOOD_ID, *CORRUPT]:
            assert (await store.get(job_id)).to_openai()["id"] == job_id
        view = await collect_fleet_view(client, Keys())
        check_rows(view["batch_jobs"])
    finally:
        await client.aclose()


async def test_the_batches_api_and_the_status_page_show_corrupt_records(records, make_client) -> None:
    client = await make_client(batch_ingester=False)
    response = await client.get("/v1/batches", params={"limit": "100"})
    assert response.status == 200, await response.text()
    check_batches((await response.json())["data"])
    page = await client.get("/v1/batches", params={"limit": "3", "after": "bad-count"})  # paging past them
    assert page.status == 200 and len((await page.json())["data"]) == 3
    for job_id, (_, bad_field) in CORRUPT.items():
        response = await client.get(f"/v1/batches/{job_id}")
        assert response.status == 200, (job_id, await response.text())
        batch = await response.json()
        assert batch["status"] == "failed" and batch["errors"]["data"][-1]["param"] == bad_field, batch
    fleet = await client.get("/fleet.json")
    assert fleet.status == 200, await fleet.text()
    check_rows((await fleet.json())["batch_jobs"])
    assert (await client.get("/")).status == 200
