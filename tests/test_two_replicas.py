"""Issue 32, item 1: a healthy two-replica fleet (the default model, 24 concurrent streams through
the openai SDK) fails no stream. testkit/two_replicas.py is the check; this runs it once
(`--runs 20` by hand)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def test_two_replicas_serve_24_concurrent_streams_without_a_failed_one(smollm2):
    done = subprocess.run([sys.executable, "-m", "testkit.two_replicas", "--runs", "1"], capture_output=True,
                          text=True, timeout=900, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "1 runs, 24 streams, 0 failed" in done.stdout
