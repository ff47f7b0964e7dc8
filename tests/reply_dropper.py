"""A relay in front of a Redis server that loses one reply on demand, for the tests: the
command has run on Redis, and the client sees its connection closed instead of the answer
(what a Redis that stops at that moment, or a network that drops then, does)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from shared.net import free_port


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
