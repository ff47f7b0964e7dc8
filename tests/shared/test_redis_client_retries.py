"""Our Redis clients never retry a command by themselves: a write whose reply was lost reaches
the caller as an error (whose own retry is written to be safe to repeat), instead of being
sent again behind its back. Against a real Redis server, through a relay that loses a reply."""

from __future__ import annotations

import pytest
import redis

from shared.redis_client import connect, connect_async
from tests.reply_dropper import ReplyDropper


def test_a_write_whose_reply_is_lost_is_not_sent_again_by_the_client(redis_server) -> None:
    with ReplyDropper(redis_server.port) as relay:
        client = connect(relay.url, socket_timeout=10)
        client.ping()  # (connected: the next reply is the command's)
        relay.armed.set()
        with pytest.raises(redis.ConnectionError):
            client.incr("k")
        assert relay.num_dropped == 1
        assert redis_server.client().get("k") == b"1"  # ran once, and the caller knows it failed
        assert client.incr("k") == 2  # the next command reconnects
        client.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("blocking_pool", [False, True])
async def test_an_async_write_whose_reply_is_lost_is_not_sent_again_by_the_client(
        redis_server, blocking_pool: bool) -> None:
    with ReplyDropper(redis_server.port) as relay:
        client = connect_async(relay.url, max_connections=4, blocking_pool=blocking_pool, socket_timeout=10)
        try:
            await client.ping()
            relay.armed.set()
            with pytest.raises(redis.ConnectionError):
                await client.xadd("s", {"m": "x"})
            assert relay.num_dropped == 1
            assert redis_server.client().xlen("s") == 1
        finally:
            await client.aclose()
