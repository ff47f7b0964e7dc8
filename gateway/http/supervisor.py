"""`tokenfleet gateway --workers N`: N gateway processes on one port, started and watched by
the process the command runs in.

- Each worker is a whole gateway in a fresh interpreter (multiprocessing's spawn): its own
  Redis connections, its own pub/sub connection, its own batch ingester (ingesters share
  the work through their consumer groups and fenced steps, any number of them). Each binds
  the port with SO_REUSEPORT, and the kernel spreads new connections over them.
- The parent serves nothing. It waits until every worker has its port open, then watches
  them: a worker that dies is started again; one that dies before the first start is done,
  or workers that die more than MAX_RESTARTS times within RESTART_WINDOW_S, stop them all
  and the command exits 1.
- SIGINT / SIGTERM: every worker gets SIGTERM and closes its open streams for up to
  server.SHUTDOWN_TIMEOUT_S; what is left after STOP_TIMEOUT_S gets SIGKILL. A worker also
  asks the kernel for SIGTERM should the parent die first (PR_SET_PDEATHSIG, Linux), so
  none is left behind even when the parent is killed outright.
- /metrics: prometheus_client's multiprocess mode in a directory the parent makes
  (PROMETHEUS_MULTIPROC_DIR, unless already set): whichever worker answers shows the whole
  gateway: counters and histograms summed over the workers, dead ones included;
  active_streams summed over the live workers; the fleet gauges as last set by any worker.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.errors import TokenfleetError
from shared.logging import configure_logging, get_logger
from shared.pdeathsig import die_with_parent

if TYPE_CHECKING:
    from gateway.core.settings import GatewaySettings

READY_TIMEOUT_S = 300.0  # a worker loads every fronted model's tokenizer before it opens the port
STOP_TIMEOUT_S = 20.0
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

log = get_logger("tokenfleet.gateway.supervisor")


def _worker_main(settings: GatewaySettings, index: int, ready, parent_pid: int) -> None:
    die_with_parent()
    if os.getppid() != parent_pid:
        return  # the parent died before the kernel could be told
    configure_logging(os.environ.get("TOKENFLEET_LOG_LEVEL", "WARNING"))
    # Only now: the gateway's modules bind their loggers as they are imported.
    from gateway.http.server import serve

    serve(settings, reuse_port=True, on_ready=lambda: ready.put((index, os.getpid())))


@dataclass
class _Worker:
    index: int
    process: multiprocessing.process.BaseProcess
    is_ready: bool = False


@dataclass
class GatewayWorkers:
    """The gateway's worker pool. Not tokenfleet.supervise's Supervisor: the workers are spawned
    interpreters handed the settings object, each reporting ready over a queue once its port is
    open, restarted within a window (MAX_RESTARTS in RESTART_WINDOW_S) rather than with backoff,
    and the gateway layer cannot import tokenfleet."""

    settings: GatewaySettings
    num_workers: int
    workers: dict[int, _Worker] = field(default_factory=dict)  # worker index -> its process
    _restarts: deque = field(default_factory=deque)  # monotonic times of recent restarts
    _stopping: bool = False

    def __post_init__(self) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._ready = self._ctx.SimpleQueue()

    def run(self) -> int:
        """Until SIGINT/SIGTERM (0) or workers that cannot be kept up (1)."""
        _check_port_free(self.settings.host, self.settings.port)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        metrics_dir = self._metrics_dir()
        try:
            for index in range(self.num_workers):
                self._start(index)
            if not self._wait_ready():
                return 0 if self._stopping else 1
            log.info("gateway_workers_ready", num_workers=self.num_workers, port=self.settings.port,
                     pids=[w.process.pid for w in self.workers.values()])
            return self._watch()
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if metrics_dir is not None:
                shutil.rmtree(metrics_dir, ignore_errors=True)
                os.environ.pop(MULTIPROC_ENV, None)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stopping = True

    def _metrics_dir(self) -> str | None:
        """A fresh directory for the workers' metric files; None when the caller set one."""
        if os.environ.get(MULTIPROC_ENV):
            return None
        path = tempfile.mkdtemp(prefix="tokenfleet-gateway-metrics-")
        os.environ[MULTIPROC_ENV] = path  # the workers inherit it
        return path

    def _start(self, index: int) -> None:
        process = self._ctx.Process(target=_worker_main, name=f"gateway-worker-{index}", daemon=False,
                                    args=(self.settings, index, self._ready, os.getpid()))
        process.start()
        self.workers[index] = _Worker(index, process)
        log.info("gateway_worker_started", worker=index, pid=process.pid)

    def _drain_ready(self) -> None:
        while not self._ready.empty():
            index, pid = self._ready.get()
            worker = self.workers.get(index)
            if worker is not None and worker.process.pid == pid:
                worker.is_ready = True

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._stopping:
            self._drain_ready()
            if all(w.is_ready for w in self.workers.values()):
                return True
            dead = [w for w in self.workers.values() if w.process.exitcode is not None]
            if dead:
                worker = dead[0]
                log.error("gateway_worker_failed_to_start", worker=worker.index, code=worker.process.exitcode)
                return False
            if time.monotonic() > deadline:
                log.error("gateway_workers_not_ready", timeout_s=READY_TIMEOUT_S)
                return False
            self._sleep(0.1)
        return False

    def _watch(self) -> int:
        while not self._stopping:
            self._drain_ready()
            for worker in list(self.workers.values()):
                code = worker.process.exitcode
                if code is None or self._stopping:
                    continue
                pid = worker.process.pid
                self._forget(worker)
                del self.workers[worker.index]
                now = time.monotonic()
                while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
                    self._restarts.popleft()
                if len(self._restarts) >= MAX_RESTARTS:
                    log.error("gateway_workers_keep_dying", worker=worker.index, code=code,
                              restarts=len(self._restarts), window_s=RESTART_WINDOW_S)
                    return 1
                self._restarts.append(now)
                log.warning("gateway_worker_died", worker=worker.index, pid=pid, code=code)
                self._start(worker.index)
            self._sleep(0.5)
        return 0

    def _sleep(self, timeout_s: float) -> None:
        """Until a worker exits or timeout_s; a signal ends it early too."""
        sentinels = [w.process.sentinel for w in self.workers.values() if w.process.exitcode is None]
        if sentinels:
            multiprocessing.connection.wait(sentinels, timeout_s)
        else:
            time.sleep(timeout_s)

    def _forget(self, worker: _Worker) -> None:
        """A worker that ended: its live gauges leave /metrics (its counters stay in the sums)."""
        directory = os.environ.get(MULTIPROC_ENV)
        if directory and worker.process.pid is not None:
            from prometheus_client import multiprocess

            with contextlib.suppress(OSError):
                multiprocess.mark_process_dead(worker.process.pid, directory)
        worker.process.close()

    def _stop_all(self) -> None:
        alive = [w for w in self.workers.values() if w.process.exitcode is None]
        for worker in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for worker in alive:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.exitcode is None:
                log.warning("gateway_worker_killed", worker=worker.index, pid=worker.process.pid)
                worker.process.kill()
                worker.process.join()
        self.workers.clear()


def _check_port_free(host: str, port: int) -> None:
    """SO_REUSEPORT would let the workers share the port with a process that holds it already
    (an old gateway, same user): refuse instead, as a single gateway's bind does."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the workers bind: TIME_WAIT is fine
        try:
            probe.bind(address)
        except OSError as exc:
            raise TokenfleetError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def run_workers(settings: GatewaySettings, num_workers: int) -> int:
    return GatewayWorkers(settings, num_workers).run()
