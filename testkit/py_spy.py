"""py-spy recordings of a fleet's processes, as the GPU benchmarks take them: raw format with
threads and subprocesses (a scheduler's publishers, a gateway's workers), so that
`python -m testkit.spy_summary FILE` can sum them up per process and thread.

py-spy's own report (its sample and error counts, "behind" warnings) goes to FILE.log beside
the profile: a profile with few samples says why there. The default reads the running process
without pausing it (a torn stack is an error, rarely: 5 in 5,715 on the H200). `blocking` pauses
the process for each sample: none is torn, but the host slows (a busy process by a third on a
2-core CPU at 200 Hz) while a GPU runs on, so the share of time it shows waiting on the GPU
shrinks. Start a recording with the load it is for, not before: idle time is left out of a
profile, so a window that caught client processes' imports holds a few idle samples."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def is_available() -> bool:
    return shutil.which("py-spy") is not None


def record(pid: int, seconds: float, out: Path, rate_hz: int = 200,
           blocking: bool = False) -> subprocess.Popen:
    """Start recording pid and its children for `seconds` into `out` (py-spy's report into
    out + ".log"); wait() on the result."""
    command = ["py-spy", "record", "-p", str(pid), "-d", str(int(seconds)), "-r", str(rate_hz),
               "--subprocesses", "--threads", "-f", "raw", "-o", str(out)]
    if not blocking:
        command.insert(2, "--nonblocking")
    with open(f"{out}.log", "wb") as report:
        return subprocess.Popen(command, stdout=report, stderr=subprocess.STDOUT)
