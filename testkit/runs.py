"""A benchmark run: the exact command line first, a timestamped log, percentiles, SIGTERM as an
exception (print the table so far), enough file descriptors for many streams."""

from __future__ import annotations

import math
import os
import resource
import shlex
import signal
import sys
import time

T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {message}", flush=True)


def print_command() -> None:
    """The exact command line, first thing: a table without it cannot be reproduced."""
    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    print("$", shlex.join([python, *sys.argv]), flush=True)


class Interrupted(BaseException):
    """SIGTERM (e.g. from `timeout`): stop measuring, print the table so far."""


def stop_on_sigterm() -> None:
    def handler(signum, frame):
        raise Interrupted()

    signal.signal(signal.SIGTERM, handler)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]




def raise_fd_limit(needed: int) -> None:
    """Many concurrent streams need many descriptors; children inherit the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard == resource.RLIM_INFINITY else min(hard, max(soft, needed))
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft < needed:
        print(f"warning: RLIMIT_NOFILE is {soft}, below the ~{needed} descriptors this run needs")

