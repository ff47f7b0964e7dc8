"""Tenants cannot see each other's work (fake scheduler, real Redis): another tenant's request,
event stream, file or batch job is a 404 (as OpenAI answers another project's ids), lists show
one's own, and the fleet-wide views (/fleet.json, /metrics) need an admin key. A fleet without
tenants keeps showing everything to everyone."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from gateway.tenants.directory import TenantDirectory, key_digest
from protocol.keys import Keys
from tests.gateway.conftest import MODEL
from tests.gateway.fake_scheduler import FakeScheduler

pytestmark = pytest.mark.asyncio
KEYS = Keys()
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
SUBMIT = {**CHAT, "kind": "chat"}
LINE = {"method": "POST", "url": "/v1/chat/completions", "body": CHAT}


def tenants() -> TenantDirectory:
    return TenantDirectory.from_map({"tenants": {
        "team-a": {"keys": ["key-a"]},
        "team-b": {"keys": ["key-b"]},
        "ops": {"keys": ["key-ops"], "admin": True},
    }})


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def upload(client, key: str | None, lines: int = 2) -> str:
    content = "\n".join(json.dumps({**LINE, "custom_id": f"c{i}"}) for i in range(lines))
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key or "unused", max_retries=0)
    try:
        return (await sdk.files.create(file=("job.jsonl", content.encode()), purpose="batch")).id
    finally:
        await sdk.close()


async def wait_batch(client, batch_id: str, key: str, statuses=("completed",)) -> dict:
    batch: dict = {}
    for _ in range(400):
        batch = await (await client.get(f"/v1/batches/{batch_id}", headers=auth(key))).json()
        if batch.get("status") in statuses:  # (a 404 until the ingester took it in)
            return batch
        await asyncio.sleep(0.05)
    raise AssertionError(f"batch {batch_id} is still {batch}")


async def test_another_tenants_request_is_a_404_to_read_stream_and_cancel(make_client, redis_server,
                                                                          tokenizer):
    with FakeScheduler(redis_server.url, MODEL, tokenizer, consume=False):  # alive, takes nothing
        client = await make_client(tenants=tenants(), api_keys=("plain",))
        req_id = (await (await client.post("/v1/requests", json=SUBMIT, headers=auth("key-a"))).json())["id"]
        for key in ("key-b", "plain"):
            for method, path in (("GET", f"/v1/requests/{req_id}"), ("GET", f"/v1/requests/{req_id}/events"),
                                 ("DELETE", f"/v1/requests/{req_id}")):
                response = await client.request(method, path, headers=auth(key))
                assert response.status == 404, (key, method, path)
                error = (await response.json())["error"]
                assert error["code"] == "request_not_found"
                assert "unknown" in error["message"]  # the same words as for an id nobody has
        assert redis_server.client().exists(KEYS.cancelled(req_id)) == 0  # B's DELETE cancelled nothing
        mine = await client.get(f"/v1/requests/{req_id}", headers=auth("key-a"))
        assert mine.status == 200 and (await mine.json())["status"] == "queued"
        assert (await client.get(f"/v1/requests/{req_id}", headers=auth("key-ops"))).status == 200  # admin
        # A request without a tenant (a plain --api-key) is no tenant's: tenants do not see it.
        plain = await client.post("/v1/requests", json=SUBMIT, headers=auth("plain"))
        plain_id = (await plain.json())["id"]
        assert (await client.get(f"/v1/requests/{plain_id}", headers=auth("plain"))).status == 200
        assert (await client.get(f"/v1/requests/{plain_id}", headers=auth("key-a"))).status == 404
        cancelled = await client.delete(f"/v1/requests/{req_id}", headers=auth("key-a"))
        assert (await cancelled.json())["status"] == "cancelled"


async def test_another_tenants_file_is_a_404_and_lists_show_ones_own(make_client, fake_scheduler):
    client = await make_client(tenants=tenants())
    file_a = await upload(client, "key-a")
    file_b = await upload(client, "key-b")
    for method, path in (("GET", f"/v1/files/{file_a}"), ("GET", f"/v1/files/{file_a}/content"),
                         ("DELETE", f"/v1/files/{file_a}")):
        response = await client.request(method, path, headers=auth("key-b"))
        assert response.status == 404, (method, path)
        assert (await response.json())["error"]["param"] == "file_id"
    refused = await client.post("/v1/batches", headers=auth("key-b"), json={
        "input_file_id": file_a, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert refused.status == 404 and (await refused.json())["error"]["param"] == "input_file_id"
    content = await client.get(f"/v1/files/{file_a}/content", headers=auth("key-a"))
    assert content.status == 200 and b"c1" in await content.read()  # B's DELETE deleted nothing
    listed = {}
    for key in ("key-a", "key-b", "key-ops"):
        page = await (await client.get("/v1/files", headers=auth(key))).json()
        listed[key] = [f["id"] for f in page["data"]]
    assert listed["key-a"] == [file_a] and listed["key-b"] == [file_b]
    assert set(listed["key-ops"]) >= {file_a, file_b}
    assert (await client.delete(f"/v1/files/{file_a}", headers=auth("key-a"))).status == 200


async def test_another_tenants_batch_is_a_404_and_the_list_shows_ones_own(make_client, redis_server,
                                                                          tokenizer):
    with FakeScheduler(redis_server.url, MODEL, tokenizer, consume=False):  # the jobs stay in progress
        client = await make_client(tenants=tenants(), batch_lease_s=2.0)
        body = {"input_file_id": await upload(client, "key-a"), "endpoint": "/v1/chat/completions",
                "completion_window": "24h"}
        batch_a = (await (await client.post("/v1/batches", json=body, headers=auth("key-a"))).json())["id"]
        body["input_file_id"] = await upload(client, "key-b")
        batch_b = (await (await client.post("/v1/batches", json=body, headers=auth("key-b"))).json())["id"]
        # A job written straight into tf:batch:in without a tenant is no tenant's.
        redis_server.client().xadd(KEYS.batch_in, {"job_id": "nobodys-1", "model": MODEL,
                                                    "lines": json.dumps({**LINE, "custom_id": "x"})})
        await wait_batch(client, batch_a, "key-a", ("in_progress",))
        await wait_batch(client, "nobodys-1", "key-ops", ("in_progress",))
        for method, path in (("GET", f"/v1/batches/{batch_a}"), ("POST", f"/v1/batches/{batch_a}/cancel"),
                             ("GET", "/v1/batches/nobodys-1"), ("POST", "/v1/batches/nobodys-1/cancel")):
            response = await client.request(method, path, headers=auth("key-b"))
            assert response.status == 404, (method, path)
            assert (await response.json())["error"]["param"] == "batch_id"
        assert (await wait_batch(client, batch_a, "key-a", ("in_progress",)))["status"] == "in_progress"

        async def listed(key: str, **query) -> list[str]:
            page = await (await client.get("/v1/batches", params=query, headers=auth(key))).json()
            return [b["id"] for b in page["data"]]

        assert await listed("key-a") == [batch_a]
        assert await listed("key-b") == [batch_b]
        assert {batch_a, batch_b, "nobodys-1"} <= set(await listed("key-ops"))
        # Pages count one's own jobs only: a page of one still finds the next of one's own.
        body["input_file_id"] = await upload(client, "key-a")
        batch_a2 = (await (await client.post("/v1/batches", json=body, headers=auth("key-a"))).json())["id"]
        first = await (await client.get("/v1/batches", params={"limit": "1"}, headers=auth("key-a"))).json()
        assert [b["id"] for b in first["data"]] == [batch_a2] and first["has_more"]
        assert await listed("key-a", limit="1", after=batch_a2) == [batch_a]
        last = await (await client.get("/v1/batches", params={"limit": "1", "after": batch_a},
                                       headers=auth("key-a"))).json()
        assert last["data"] == [] and not last["has_more"]
        cancelled = await client.post(f"/v1/batches/{batch_a}/cancel", headers=auth("key-a"))
        assert cancelled.status == 200 and (await cancelled.json())["status"] in ("cancelling", "cancelled")


async def test_the_fleet_views_need_an_admin_key_once_tenants_are_configured(make_client, fake_scheduler):
    client = await make_client(tenants=tenants())
    for path in ("/fleet.json", "/metrics"):
        missing = await client.get(path)
        assert missing.status == 401, path
        assert (await missing.json())["error"]["type"] == "authentication_error"
        refused = await client.get(path, headers=auth("key-a"))
        assert refused.status == 403, path
        assert (await refused.json())["error"]["code"] == "admin_key_required"
        assert (await client.get(path, headers=auth("key-ops"))).status == 200, path
    view = await (await client.get("/fleet.json", headers=auth("key-ops"))).json()
    assert "batch_jobs" in view and "schedulers" in view
    page = await client.get("/")  # the page itself is open; the data it polls is not
    assert page.status == 200 and "text/html" in page.headers["Content-Type"]
    assert "Authorization" in await page.text()  # it asks for a key and sends it


async def test_a_fleet_without_tenants_shows_everything_to_every_key(make_client, fake_scheduler):
    client = await make_client(api_keys=("k1", "k2"))
    req_id = (await (await client.post("/v1/requests", json=SUBMIT, headers=auth("k1"))).json())["id"]
    assert (await client.get(f"/v1/requests/{req_id}", headers=auth("k2"))).status == 200
    file_id = await upload(client, "k1")
    assert (await client.get(f"/v1/files/{file_id}/content", headers=auth("k2"))).status == 200
    listed = await (await client.get("/v1/files", headers=auth("k2"))).json()
    assert file_id in [f["id"] for f in listed["data"]]
    assert (await client.get("/fleet.json", headers=auth("k2"))).status == 200  # any key, no admin
    assert (await client.get("/metrics", headers=auth("k1"))).status == 200
    open_client = await make_client()
    assert (await open_client.get(f"/v1/requests/{req_id}")).status == 200
    assert (await open_client.get("/v1/files")).status == 200


async def test_batch_results_are_listed_files_of_the_batchs_tenant(make_client, redis_server, tokenizer):
    with FakeScheduler(redis_server.url, MODEL, tokenizer, kinds=("interactive", "batch")):
        client = await make_client(tenants=tenants(), batch_lease_s=2.0)
        sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="key-a", max_retries=0)
        try:
            uploaded = await upload(client, "key-a", lines=3)
            batch = await sdk.batches.create(input_file_id=uploaded, endpoint="/v1/chat/completions",
                                             completion_window="24h")
            done = await wait_batch(client, batch.id, "key-a")
            assert done["output_file_id"] == f"file-{batch.id}-output"
            files = {f.id: f for f in (await sdk.files.list()).data}
            output = files[done["output_file_id"]]
            assert output.purpose == "batch_output" and files[uploaded].purpose == "batch"
            content = (await sdk.files.content(output.id)).content
            assert output.bytes == len(content) and len(content.splitlines()) == 3
            assert (await sdk.files.retrieve(output.id)).bytes == output.bytes
            assert list(files)[:2] == [output.id, uploaded]  # newest first
            for key in ("key-b",):
                other = await client.get("/v1/files", headers=auth(key))
                assert output.id not in [f["id"] for f in (await other.json())["data"]]
                assert (await client.get(f"/v1/files/{output.id}/content", headers=auth(key))).status == 404
                assert (await client.get(f"/v1/files/{output.id}", headers=auth(key))).status == 404
            admin = await (await client.get("/v1/files", headers=auth("key-ops"))).json()
            assert output.id in [f["id"] for f in admin["data"]]
        finally:
            await sdk.close()


async def test_a_tenant_kept_in_redis_is_an_admin_with_admin_1(make_client, fake_scheduler, redis_server):
    plain = redis_server.client()
    for name, key in (("ops-r", "key-ops-r"), ("team-r", "key-r")):
        plain.hset(KEYS.api_keys, key_digest(key), name)
        plain.hset(KEYS.tenant(name), "requests_per_minute", 600)
    plain.hset(KEYS.tenant("ops-r"), "admin", 1)
    client = await make_client(tenants_from_redis=True)
    assert (await client.get("/fleet.json", headers=auth("key-ops-r"))).status == 200
    assert (await client.get("/fleet.json", headers=auth("key-r"))).status == 403


async def test_a_tenant_added_by_hand_with_its_key_alone_is_served_with_no_limits(make_client, fake_scheduler,
                                                                                 redis_server):
    plain = redis_server.client()
    plain.hset(KEYS.api_keys, key_digest("key-hand"), "team-hand")  # no tf:tenant:team-hand hash
    plain.hset(KEYS.api_keys, key_digest("key-odd"), "no good: a space")  # not a usable name
    client = await make_client(tenants_from_redis=True)
    for _ in range(3):
        served = await client.post("/v1/requests", json=SUBMIT, headers=auth("key-hand"))
        assert served.status == 202, await served.text()
    assert fake_scheduler.client.sismember(KEYS.tenants(MODEL), "team-hand")  # queued as that tenant's
    assert (await client.post("/v1/requests", json=SUBMIT, headers=auth("key-odd"))).status == 401
    assert (await client.get("/fleet.json", headers=auth("key-hand"))).status == 403  # not an admin


async def test_a_page_of_ones_own_ids_reads_past_other_tenants_chunks(redis_server):
    import redis.asyncio as aioredis

    from gateway.tenants.access import Caller, visible_ids

    client = aioredis.Redis.from_url(redis_server.url)
    try:
        for i in range(9):  # newest first: j8 .. j0; team-a's are j0 and j4
            await client.zadd("idx", {f"j{i}": i})
            await client.hset(f"rec:{i}", "tenant", "team-a" if i in (0, 4) else "team-b")
        mine = Caller("team-a", sees_everything=False)
        key = lambda item_id: f"rec:{item_id[1:]}"  # noqa: E731
        assert await visible_ids(client, "idx", key, mine, count=5, chunk=2) == ["j4", "j0"]
        assert await visible_ids(client, "idx", key, mine, count=1, chunk=2) == ["j4"]
        assert await visible_ids(client, "idx", key, mine, start=5, count=5, chunk=2) == ["j0"]
        everyone = Caller(None, sees_everything=True)
        assert await visible_ids(client, "idx", key, everyone, count=3, chunk=2) == ["j8", "j7", "j6"]
        assert await visible_ids(client, "idx", key, Caller(None, False), count=5) == []  # no tenant's: none
    finally:
        await client.aclose()
