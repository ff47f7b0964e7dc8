"""Taking over a dead consumer's pending entries, on the real Redis 6.2 server we ship with."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aioredis

from protocol.abandoned import claim_abandoned, claim_abandoned_async


def _stream_with_a_dead_consumer(client: redis.Redis) -> tuple[bytes, bytes, bytes]:
    """Three entries read by consumer "dead"; the middle one then deleted while still pending."""
    client.xgroup_create("s", "g", id="0", mkstream=True)
    ids = [client.xadd("s", {"n": str(i)}) for i in range(3)]
    client.xreadgroup("g", "dead", {"s": ">"})
    client.xdel("s", ids[1])
    return tuple(ids)


def test_live_entries_change_hands_and_deleted_ones_leave_the_pending_list(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    first, deleted, last = _stream_with_a_dead_consumer(client)
    live, gone = claim_abandoned(client, "s", "g", "heir", 0, count=10)
    assert [(entry_id, fields[b"n"]) for entry_id, fields in live] == [(first, b"0"), (last, b"2")]
    assert gone == [deleted]
    pending = client.xpending_range("s", "g", "-", "+", 10)
    assert [(p["message_id"], p["consumer"]) for p in pending] == [(first, b"heir"), (last, b"heir")]
    # A second takeover sees the same two (still idle), and nothing deleted any more.
    again, gone = claim_abandoned(client, "s", "g", "other", 0, count=10)
    assert [entry_id for entry_id, _ in again] == [first, last] and gone == []


def test_entries_not_idle_long_enough_stay_with_their_owner(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    _stream_with_a_dead_consumer(client)
    assert claim_abandoned(client, "s", "g", "heir", 60_000, count=10) == ([], [])
    assert {p["consumer"] for p in client.xpending_range("s", "g", "-", "+", 10)} == {b"dead"}


def test_the_asyncio_version_does_the_same(redis_server):
    first, deleted, last = _stream_with_a_dead_consumer(redis.Redis.from_url(redis_server.url))

    async def take_over():
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            return await claim_abandoned_async(client, "s", "g", "heir", 0, count=10)
        finally:
            await client.aclose()

    live, gone = asyncio.run(take_over())
    assert [entry_id for entry_id, _ in live] == [first, last] and gone == [deleted]
