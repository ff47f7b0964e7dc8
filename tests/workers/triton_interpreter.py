"""Run a check under Triton's CPU interpreter (TRITON_INTERPRET=1), in a fresh process: the
variable is read when Triton is imported, so it cannot be turned on inside this one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(code: str, timeout_s: float = 300, args: list[str] | None = None) -> None:
    """Run `code` (which prints "ok" last when its checks pass); fail with its stderr otherwise."""
    # The repository first, then whatever the caller had (the GPU host's packages live there: a
    # PYTHONPATH of the repository alone left structlog unimportable in the child).
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run([sys.executable, "-c", code, *(args or [])], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
