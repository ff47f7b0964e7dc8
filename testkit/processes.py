"""A benchmark's child processes (Redis, schedulers, gateways, `tokenfleet up`) on the fleet's
own supervisor, and what is measured of them: readiness, CPU time, peak memory; a redis-server
with a chosen fsync policy; a scheduler and a gateway started as deployed."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import redis

from protocol import registry
from protocol.keys import Keys
from shared.net import free_port
from tokenfleet.supervise import NEVER_RESTART, Supervisor, tail_lines

ROOT = Path(__file__).resolve().parent.parent
STOP_TIMEOUT_S = 15.0
CLI = [sys.executable, "-m", "tokenfleet.cli"]


class Children:
    """Child processes, each in its own session with its log in log_dir, never restarted (an exit
    is a failed run), dying with this process even when it is killed; stopped in reverse order
    of start, each with its whole process group (SIGTERM, then SIGKILL)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.supervisor = Supervisor(log_dir, die_with_parent=True, cwd=ROOT)

    def spawn(self, name: str, argv: list[str]) -> int:
        """Start `name` now; its pid."""
        env = {**os.environ, "TOKENFLEET_LOG_LEVEL": os.environ.get("TOKENFLEET_LOG_LEVEL", "WARNING")}
        return self.supervisor.add(name, argv, env, NEVER_RESTART)

    def pid(self, name: str) -> int:
        return self.supervisor.pid(name)

    def check(self) -> None:
        """ChildGaveUp (its exit and the end of its log) for the first child that has exited."""
        self.supervisor.check_all_running()

    def tail(self, name: str, num_lines: int = 40) -> str:
        return "\n".join(tail_lines(self.log_dir / f"{name}.log", num_lines))

    def stop(self) -> None:
        # A second Ctrl-C (or SIGTERM) must not cut the cleanup short.
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.supervisor.stop_all(timeout_s=STOP_TIMEOUT_S)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def wait_ready(url: str, children: Children, timeout_s: float = 180.0) -> None:
    """Until the gateway at url answers /ready with 200 (Redis reachable, a scheduler serving)."""
    deadline = time.monotonic() + timeout_s
    while True:
        children.check()
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except (OSError, urllib.error.HTTPError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway was not ready within {timeout_s:.0f} s")
        time.sleep(0.2)


def start_redis(children: Children, data_dir: Path, *, appendfsync: str = "always") -> tuple[str, int]:
    """redis-server as tokenfleet/redis_server.py starts it (append-only file), with a chosen
    fsync policy; (url, port)."""
    from tokenfleet.redis_server import redis_server_binary, wait_for_redis

    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    children.spawn("redis-server", [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                                    "--dir", str(data_dir), "--appendonly", "yes",
                                    "--appendfsync", appendfsync, "--save", ""])
    url = f"redis://127.0.0.1:{port}/0"
    wait_for_redis(url, check=children.check)
    return url, port


def cpu_seconds(proc: psutil.Process, *, tree: bool = True) -> float:
    """User + system seconds of a process; with tree, also of the children it has reaped and of
    its live descendants (a scheduler's Ray processes, say)."""
    try:
        times = proc.cpu_times()
        if not tree:
            return times.user + times.system
        total = times.user + times.system + times.children_user + times.children_system
        descendants = proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = child.cpu_times()
            total += times.user + times.system
    return total


class CpuMeter:
    """CPU seconds each named process spends between start() and stop(): other processes with
    their descendants, this one alone (its children are measuring apparatus)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.before: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        return {name: cpu_seconds(p, tree=p.pid != os.getpid()) for name, p in self.procs.items()}

    def start(self) -> None:
        self.before = self._read()

    def stop(self) -> dict[str, float]:
        return {name: seconds - self.before[name] for name, seconds in self._read().items()}


def start_scheduler(children: Children, redis_url: str, model: str | Path, *flags: str,
                    scheduler_id: str | None = None, ready_s: float = 600.0) -> None:
    """`tokenfleet scheduler` as deployed (its own process, its loop on the main thread) for
    model, with flags; given scheduler_id, returns once its first heartbeat is in Redis (loaded
    and looping: a large checkpoint and its CUDA graphs may take minutes)."""
    argv = [*CLI, "scheduler", "--redis-url", redis_url, "--model", str(model), *flags]
    if scheduler_id is not None:
        argv += ["--scheduler-id", scheduler_id]
    children.spawn("scheduler", argv)
    if scheduler_id is None:
        return
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + ready_s
    while scheduler_id not in registry.live_members(client, Keys())[registry.SCHEDULERS]:
        children.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the scheduler was not up within {ready_s:.0f} s")
        time.sleep(0.2)


def start_gateway(children: Children, redis_url: str, model: str | Path, *flags: str,
                  port: int | None = None, python_flags: tuple[str, ...] = ()) -> tuple[str, int]:
    """`tokenfleet gateway` for model, with flags (python_flags go to its interpreter: cProfile,
    say); returns (its base URL, its pid) once it is ready."""
    port = port or free_port()
    pid = children.spawn("gateway", [sys.executable, *python_flags, *CLI[1:], "gateway", "--redis-url",
                                     redis_url, "--port", str(port), "--model", str(model), *flags])
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, children)
    return url, pid


class RssSampler(threading.Thread):
    """A process's RSS every interval_s, and the kernel's high-water mark (VmHWM) after a reset."""

    def __init__(self, pid: int, interval_s: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.pid = pid
        self.interval_s = interval_s
        self.peak = 0
        self.hwm_reset = False
        self._halt = threading.Event()

    def reset_hwm(self) -> None:
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False

    def hwm(self) -> int | None:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def rss(self) -> int:
        return self.proc.memory_info().rss

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.peak = max(self.peak, self.rss())
            except psutil.Error:
                return  # the process is gone (the run was interrupted)
            self._halt.wait(self.interval_s)

    def finish(self) -> int:
        """Stop sampling; the peak RSS seen (or the high-water mark, when larger)."""
        self._halt.set()
        self.join()
        peak = max(self.peak, self.rss())
        hwm = self.hwm() if self.hwm_reset else None
        return max(peak, hwm or 0)
