"""py-spy recordings of a fleet's processes, as the GPU benchmarks take them: raw format with
threads and subprocesses (a scheduler's publishers, a gateway's workers), so that
`python -m testkit.spy_summary FILE` can sum them up per process and thread.

py-spy's own report (its sample and error counts, "behind" warnings) goes to FILE.log beside
the profile: a profile with few samples says why there. `--nonblocking` reads a running
process's memory without pausing it, so a busy stack can be torn mid-read and the sample is
lost as an error; a serving run's scheduler once gave 63 samples in 20 s that way. Blocking
mode pauses the process for each sample (tens of µs: ~1% at 200 Hz) and loses none."""

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
