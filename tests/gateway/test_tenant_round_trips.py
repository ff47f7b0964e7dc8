"""A tenant's request costs few Redis round trips before its XADD (issue 27): its admission two
(the leases with the windows' tests, then the charges), its queueing one on a single server
(the tenant set, the script and the lease in one pipeline). Counted on a real Redis behind a
proxy that delays what clients send: a round trip then lasts at least that long. And what
the one pipeline writes is what the three wrote."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis.asyncio as aioredis

from gateway.serving.store import GatewayKeys, RequestStore, Submission
from gateway.tenants.directory import Tenant, TenantLimits
from gateway.tenants.limits import TenantLimiter
from protocol.messages import RequestMessage
from shared.sampling import SamplingParams

pytestmark = pytest.mark.asyncio

# Long against what a loaded machine adds to a step (0.18 s seen with two test workers and other
# work on two cores): the bounds below leave 0.35 s of slack under the next round trip.
DELAY_S = 0.5
TENANT = Tenant("acme", TenantLimits(requests_per_minute=1000, tokens_per_minute=10**6,
                                     max_concurrent_requests=100))


class DelayProxy:
    """127.0.0.1:port -> Redis, each chunk a client sends held for delay_s first."""

    def __init__(self, redis_port: int, delay_s: float) -> None:
        self.redis_port = redis_port
        self.delay_s = delay_s
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.redis_port)

        async def pump(source, sink, delay_s: float) -> None:
            try:
                while data := await source.read(65536):
                    if delay_s:
                        await asyncio.sleep(delay_s)
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                sink.close()

        await asyncio.gather(pump(reader, up_writer, self.delay_s), pump(up_reader, writer, 0.0))

    def close(self) -> None:
        self.server.close()


def _submission(req_id: str) -> Submission:
    message = RequestMessage.make(req_id, "m", [1, 2, 3], SamplingParams(max_tokens=4), tenant=TENANT.name,
                                  arrival_time=time.time())
    return Submission(req_id, message, "completion", lease_until=time.time() + 600)


async def test_a_tenants_request_takes_three_round_trips_to_its_entry(redis_server) -> None:
    proxy = DelayProxy(redis_server.port, DELAY_S)
    url = await proxy.start()
    client = aioredis.Redis.from_url(url)
    keys = GatewayKeys()
    limiter = TenantLimiter(client, keys, lease_s=600, pending_lease_s=30, retry_after_s=1, redis_url=url)
    store = RequestStore(client, keys, result_ttl_s=60, cancel_ttl_s=60, idempotency_ttl_s=60)
    try:
        for _ in range(2):  # warm: connections open, scripts loaded
            req_id = uuid.uuid4().hex
            await asyncio.gather(*(limiter.admit(TENANT, [req_id + tail], 10) for tail in ("", "x")))
            await store.submit([_submission(req_id)])
        req_id = uuid.uuid4().hex
        start = time.monotonic()
        await limiter.admit(TENANT, [req_id], 10)
        admitted = time.monotonic()
        assert await store.submit([_submission(req_id)]) == [None]
        queued = time.monotonic()
        assert admitted - start < 2.7 * DELAY_S  # two round trips (it took five)
        assert queued - admitted < 1.7 * DELAY_S  # one (it took three)
        direct = aioredis.Redis.from_url(redis_server.url)
        assert await direct.sismember(keys.tenants("m"), TENANT.name)
        lease = await direct.zscore(keys.tenant_leases(TENANT.name), req_id)
        assert lease is not None and lease > time.time() + 500  # its full term, not the pending one
        assert await direct.hget(keys.result(req_id), "state") == b"queued"
        await direct.aclose()
    finally:
        await client.aclose()
        proxy.close()


async def test_a_lease_ended_before_the_submit_is_not_renewed(redis_server) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    keys = GatewayKeys()
    store = RequestStore(client, keys, result_ttl_s=60, cancel_ttl_s=60, idempotency_ttl_s=60)
    try:
        req_id = uuid.uuid4().hex  # (no lease taken: as one a terminal write ended already)
        assert await store.submit([_submission(req_id)]) == [None]
        assert await client.zscore(keys.tenant_leases(TENANT.name), req_id) is None
        await client.script_flush()  # Redis lost its scripts: the submit loads it and queues anyway
        other = uuid.uuid4().hex
        assert await store.submit([_submission(other)]) == [None]
        assert await client.hget(keys.result(other), "state") == b"queued"
    finally:
        await client.aclose()
