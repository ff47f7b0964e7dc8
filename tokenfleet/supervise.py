"""Keeps named child processes running, the way docker compose's `restart: unless-stopped` or
systemd's `Restart=always` with `RestartSec` and `StartLimitBurst` would.

Two parts:

- `RestartPolicy`, pure: given how long a run lasted and how many fast failures came before
  it, says whether to start the child again and after what delay. A run shorter than
  `min_uptime_s` is a fast failure; the delay doubles with each fast failure in a row (from
  `initial_delay_s` up to `max_delay_s`), a run that lasted resets it, and the
  `max_fast_failures`-th fast failure in a row gives up (pm2's min_uptime/max_restarts).
- `Supervisor`: starts each child in its own process group (so stopping it takes its own
  children along), its output appended to `{log_dir}/{name}.log`; `poll()` reaps the dead
  ones, kills what they left in their group, and starts them again when their delay is up.
  With `die_with_parent`, the kernel sends each child SIGTERM should this process die first,
  even by SIGKILL (the benchmarks' and the chaos harness's children); `env` and `cwd` apply to
  every child. It is the one process supervisor: `tokenfleet up`, the benchmarks and the chaos
  harness (testkit.processes.Children), the tests' fleets (`spawn` alone).

API, also for code that adds and removes children at runtime (an autoscaler):

    supervisor = Supervisor(log_dir)
    supervisor.add("scheduler-2", argv, env)          # started now; restarted by poll()
    supervisor.poll()                                 # call every ~0.5 s from one loop
    supervisor.stop("scheduler-2", graceful=True)     # SIGTERM, SIGKILL after timeout_s; forgotten
    supervisor.stop_all()                             # reverse order of adding
    supervisor.names(), supervisor.pid(name), supervisor.num_restarts(name)

`add` and `stop` may be called from any thread; `poll` from one. A child that is given up on
raises `ChildGaveUp` from `poll()`, whose message names the child, its last exit and the
last lines of its log. The log file is the ring buffer of its output: the children write
straight to it (they never block on us, and outlive a supervisor that dies) and the last
lines are read back when needed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.errors import TokenfleetError
from shared.logging import get_logger
from shared.pdeathsig import die_with_parent as _die_with_parent

STOP_TIMEOUT_S = 10.0
TAIL_LINES = 20
_TAIL_BYTES = 16 << 10

log = get_logger("tokenfleet.supervise")


@dataclass(frozen=True)
class RestartPolicy:
    is_restarted: bool = True  # False: the child's exit is final (ChildGaveUp at once)
    initial_delay_s: float = 0.5
    max_delay_s: float = 30.0
    min_uptime_s: float = 10.0  # a run shorter than this is a fast failure
    max_fast_failures: int = 5  # this many fast failures in a row: give up

    def after_exit(self, uptime_s: float, num_fast_failures: int) -> tuple[float | None, int]:
        """(delay before the next start, or None to give up; fast failures in a row now)."""
        if not self.is_restarted:
            return None, num_fast_failures
        num_fast_failures = num_fast_failures + 1 if uptime_s < self.min_uptime_s else 0
        if num_fast_failures >= self.max_fast_failures:
            return None, num_fast_failures
        delay = self.initial_delay_s * 2 ** max(0, num_fast_failures - 1)
        return min(delay, self.max_delay_s), num_fast_failures


NEVER_RESTART = RestartPolicy(is_restarted=False)


class ChildGaveUp(TokenfleetError):
    """A child that stopped and will not be started again."""

    def __init__(self, name: str, code: int | None, reason: str, log_path: Path) -> None:
        self.name = name
        self.code = code
        tail = tail_lines(log_path, TAIL_LINES)
        lines = "\n".join(f"  | {line}" for line in tail) or "  | (nothing)"
        super().__init__(f"{name} {_describe_exit(code)}; {reason}. The last lines of {log_path}:\n{lines}")


@dataclass
class _Child:
    name: str
    argv: list[str]
    env: dict[str, str] | None
    policy: RestartPolicy
    log_path: Path
    process: subprocess.Popen | None = None
    started_at: float = 0.0  # monotonic
    restart_at: float | None = None  # monotonic; set while dead and waiting for its delay
    num_fast_failures: int = 0
    num_restarts: int = 0
    last_code: int | None = None


@dataclass
class Supervisor:
    log_dir: Path
    die_with_parent: bool = False  # SIGTERM to every child when this process dies (Linux)
    cwd: Path | None = None  # every child's working directory (None: this process's)
    _children: dict[str, _Child] = field(default_factory=dict)  # name -> child, in order added
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, argv: list[str], env: dict[str, str] | None = None,
            policy: RestartPolicy = RestartPolicy()) -> int:
        """Start a child now under `name` (unique among the running ones); returns its pid."""
        with self._lock:
            if name in self._children:
                raise ValueError(f"a child named {name!r} is already supervised")
            child = _Child(name, list(argv), env, policy, self.log_dir / f"{name}.log")
            self._start(child)
            self._children[name] = child
            return child.process.pid

    def stop(self, name: str, *, graceful: bool = True, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Stop a child and forget it (it is not restarted): SIGTERM to its process group, then
        SIGKILL after timeout_s (at once unless graceful). Returns its exit code (None when it
        was waiting to be restarted)."""
        with self._lock:
            child = self._children.pop(name)
        return _stop_process(child, graceful=graceful, timeout_s=timeout_s)

    def stop_all(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Every child, the last added first, each gracefully."""
        for name in reversed(self.names()):
            self.stop(name, timeout_s=timeout_s)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._children)

    def pid(self, name: str) -> int | None:
        """The running process of `name` (None while it waits to be restarted)."""
        with self._lock:
            process = self._children[name].process
            return process.pid if process is not None else None

    def num_restarts(self, name: str) -> int:
        with self._lock:
            return self._children[name].num_restarts

    def check_all_running(self) -> None:
        """Raise ChildGaveUp for the first child that has exited: while the fleet starts, an
        exit is a configuration error that no restart mends."""
        with self._lock:
            for child in self._children.values():
                code = child.process.poll() if child.process is not None else child.last_code
                if code is not None:
                    raise ChildGaveUp(child.name, code, "it exited while the fleet was starting",
                                      child.log_path)

    def poll(self) -> None:
        """Reap children that died, start again those whose delay is up; ChildGaveUp for one
        whose policy gives up."""
        now = time.monotonic()
        with self._lock:
            for child in self._children.values():
                if child.process is not None:
                    code = child.process.poll()
                    if code is None:
                        continue
                    self._reap(child, code, now)
                if child.restart_at is not None and now >= child.restart_at:
                    child.num_restarts += 1
                    self._start(child)
                    log.warning("child_restarted", child=child.name, pid=child.process.pid,
                                restarts=child.num_restarts)

    def _reap(self, child: _Child, code: int, now: float) -> None:
        _signal_group(child.process.pid, signal.SIGKILL)  # what it left in its group (e.g. gateway workers)
        child.process = None
        child.last_code = code
        uptime_s = now - child.started_at
        delay, child.num_fast_failures = child.policy.after_exit(uptime_s, child.num_fast_failures)
        if delay is None:
            reason = ("its restart policy does not restart it" if not child.policy.is_restarted else
                      f"{child.num_fast_failures} runs in a row lasted under {child.policy.min_uptime_s:g} s")
            log.error("child_gave_up", child=child.name, code=code, reason=reason)
            raise ChildGaveUp(child.name, code, reason, child.log_path)
        child.restart_at = now + delay
        log.warning("child_exited", child=child.name, code=code, uptime_s=round(uptime_s, 1),
                    restart_in_s=delay, fast_failures=child.num_fast_failures)

    def _start(self, child: _Child) -> None:
        child.process = spawn(child.argv, child.log_path, child.env, cwd=self.cwd,
                              die_with_parent=self.die_with_parent)
        child.started_at = time.monotonic()
        child.restart_at = None
        log.info("started", child=child.name, pid=child.process.pid, log=str(child.log_path))


def spawn(argv: list[str], log_path: Path | None, env: dict[str, str] | None = None, *,
          cwd: Path | None = None, die_with_parent: bool = False) -> subprocess.Popen:
    """One child in a session (and process group) of its own, so that signalling its group
    reaches whatever it starts; its output appended to log_path (None: discarded)."""
    preexec_fn = _die_with_parent if die_with_parent else None
    if log_path is None:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True, preexec_fn=preexec_fn)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:  # the child holds its own copy of the descriptor
        return subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True, preexec_fn=preexec_fn)


def stop_group(process: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S, *, graceful: bool = True,
               name: str | None = None) -> int:
    """Stop a spawned child: SIGTERM to its process group, SIGKILL to what is left after timeout_s
    (at once unless graceful); its exit code."""
    if graceful:
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("killing", child=name, pid=process.pid)
    _signal_group(process.pid, signal.SIGKILL)  # whatever the leader left behind
    return process.wait()


def _stop_process(child: _Child, *, graceful: bool, timeout_s: float) -> int | None:
    if child.process is None:
        return None
    return stop_group(child.process, timeout_s, graceful=graceful, name=child.name)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def tail_lines(path: Path, num_lines: int) -> list[str]:
    """The last num_lines lines of a file (fewer when it is shorter or missing)."""
    try:
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            size = file.tell()
            file.seek(max(0, size - _TAIL_BYTES))
            data = file.read()
    except OSError:
        return []
    lines = data.decode(errors="replace").splitlines()
    if size > _TAIL_BYTES and lines:
        lines = lines[1:]  # the first one is likely cut
    return lines[-num_lines:]
