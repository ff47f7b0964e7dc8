"""scripts/bench_gateway.py end to end on a handful of streams (a real Redis, scheduler and
gateway, as the script starts them): it prints its table and meets its goals. Before its
helpers moved to testkit, it crashed on `gateway.pid` (Children.spawn returns the pid itself)
as soon as the warm-up was done, and printed no table."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.mark.slow
def test_bench_gateway_prints_its_table_on_a_few_streams():
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_gateway.py"), "--streams", "4", "--max-tokens", "8",
         "--warmup-streams", "2"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ,
             "PYTHONPATH": os.pathsep.join([str(SCRIPTS.parent), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "| streams: errors / held open at once | 0 / " in done.stdout, done.stdout
    assert "gateway memory per stream, KiB" in done.stdout
    assert "chunks matched to listener events: 32 (0 unmatched)" in done.stdout, done.stdout
