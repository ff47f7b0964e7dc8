"""Our Redis clients never retry a command by themselves: a write whose reply was lost reaches
the caller as an error (whose own retry is written to be safe to repeat), instead of being
sent again behind its back. Against a real Redis server, through a relay that loses a reply."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
import redis

from shared.net import free_port
from shared.redis_client import connect, connect_async


class ReplyDropper:
    """Relays bytes to Redis; once armed, the next reply is not relayed: both connections are
    closed instead, after Redis ran the command (a connection lost at that very moment)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.armed = threading.Event()
        self.num_dropped = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ReplyDropper:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._relay, "127.0.0.1", self.port))
        self._started.set()
        self._loop.run_forever()
        server.close()
        relays = asyncio.all_tasks(self._loop)
        for task in relays:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*relays, return_exceptions=True))
        self._loop.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def requests() -> None:
            with contextlib.suppress(ConnectionError):
                while data := await reader.read(65536):
                    up_writer.write(data)
                    await up_writer.drain()

        async def replies() -> None:
            with contextlib.suppress(ConnectionError):
                while data := await up_reader.read(65536):
                    if self.armed.is_set():
                        self.armed.clear()
                        self.num_dropped += 1
                        break
                    writer.write(data)
                    await writer.drain()
            for end in (writer, up_writer):
                with contextlib.suppress(Exception):
                    end.close()

        await asyncio.gather(requests(), replies())


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
