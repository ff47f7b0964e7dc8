"""py-spy recordings of a fleet's processes, as the GPU benchmarks take them: raw format with
threads and subprocesses (a scheduler's publishers, a gateway's workers), so that
`python -m testkit.spy_summary FILE` can sum them up per process and thread."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def is_available() -> bool:
    return shutil.which("py-spy") is not None


def record(pid: int, seconds: float, out: Path, rate_hz: int = 200) -> subprocess.Popen:
    """Start recording pid and its children for `seconds` into `out`; wait() on the result."""
    return subprocess.Popen(
        ["py-spy", "record", "-p", str(pid), "-d", str(int(seconds)), "-r", str(rate_hz), "--nonblocking",
         "--subprocesses", "--threads", "-f", "raw", "-o", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
