"""Fleet processes as the tests start them: `tokenfleet up`, and `tokenfleet scheduler` processes
a test can drain or kill -9 (started by tokenfleet.supervise's `spawn`, as `up` starts its
children). Each test says what it runs; these say how to start, watch and stop it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from protocol import registry
from protocol.keys import Keys
from tokenfleet.supervise import spawn, stop_group

TINY_CHAT = "tiny-chat"  # the folder of the session's tiny_chat model (tests/conftest.py): its served name
KEYS = Keys()


class UpProcess:
    """`tokenfleet up ARGS` with TOKENFLEET_HOME=`home`; its output is read all along on a thread
    (a full pipe would stall it) into `lines`."""

    def __init__(self, args: list[str], home: Path, **env: str) -> None:
        self.home = home
        self.env = {**os.environ, "TOKENFLEET_HOME": str(home), **env}
        argv = [sys.executable, "-m", "tokenfleet.cli", "up", *args]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=self.env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_output(self, text: str, timeout_s: float = 300) -> None:
        """Until `text` is in up's output; fails if up exits first."""
        deadline = time.monotonic() + timeout_s
        while text not in self.output:
            assert self.process.poll() is None, self.output
            assert time.monotonic() < deadline, f"{text!r} not printed within {timeout_s} s:\n{self.output}"
            time.sleep(0.1)

    def wait_up(self, timeout_s: float = 300) -> None:
        self.wait_for_output("tokenfleet is up", timeout_s)

    def descendants(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            return psutil.Process(self.process.pid).children(recursive=True)
        return []

    def stop(self, timeout_s: float = 120) -> int:
        """SIGTERM, as Ctrl-C or a service manager stops it; its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=timeout_s)
        self._reader.join(timeout=10)
        return code


def start_scheduler(url: str, model: Path, scheduler_id: str, *args: str, model_name: str | None = None,
                    log_dir: Path | None = None) -> subprocess.Popen:
    """`tokenfleet scheduler` in a session of its own (so that killpg reaches all it starts), in
    float32; `args` are further flags. Its output goes to `log_dir`/{id}.log, or nowhere."""
    argv = [sys.executable, "-m", "tokenfleet.cli", "scheduler", "--redis-url", url, "--model", str(model),
            "--scheduler-id", scheduler_id, "--dtype", "float32", *args]
    if model_name is not None:
        argv += ["--model-name", model_name]
    log_path = log_dir / f"{scheduler_id}.log" if log_dir is not None else None
    return spawn(argv, log_path, {**os.environ, "TOKENFLEET_LOG_LEVEL": "INFO"})


def wait_heartbeat(client, scheduler_id: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until the scheduler is listed in the registry with its heartbeat (it reads its streams
    from then on, and the gateways see it)."""
    deadline = time.monotonic() + timeout_s
    while scheduler_id not in registry.read_live(client, KEYS, [registry.SCHEDULERS])[registry.SCHEDULERS]:
        assert proc.poll() is None, f"scheduler {scheduler_id} exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"scheduler {scheduler_id} never sent a heartbeat"
        time.sleep(0.1)


def stop_schedulers(*procs: subprocess.Popen | None) -> None:
    """Each one still running: SIGTERM to it and what it started, SIGKILL after 60 s."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            stop_group(proc, 60)
