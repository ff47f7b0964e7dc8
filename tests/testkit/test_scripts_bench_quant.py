"""scripts/bench_quant.py: its engines are built as `tokenfleet scheduler` builds them on the
device (async scheduling on CUDA: the batch-1 latency it reports is the served path's; it used
to build a plain EngineConfig, synchronous everywhere), and `--linears --smoke` prints
its table on this CPU, the Triton columns in the interpreter."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import DEVICE_DEFAULTS

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _bench_quant():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import bench_quant
    finally:
        sys.path.remove(str(SCRIPTS))
    return bench_quant


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_engines_take_the_config_the_scheduler_command_builds_on_the_device(device: str) -> None:
    bench_quant = _bench_quant()
    args = bench_quant.parse_args(["--device", device])
    config = bench_quant.engine_config(Path("/nonexistent"), args, "fp8")
    defaults = DEVICE_DEFAULTS[device]
    assert config.async_scheduling is defaults.async_scheduling
    assert config.max_num_batched_tokens == defaults.max_num_batched_tokens
    assert config.quantization == "fp8" and config.max_num_seqs == 512


def test_the_per_linear_table_runs_on_this_cpu_under_the_interpreter() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_quant.py"), "--linears", "--smoke", "--device", "cpu"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1",
             "PYTHONPATH": os.pathsep.join([str(SCRIPTS.parent), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "->" in line]
    assert len(rows) == 4 * 3, done.stdout  # 4 shapes x M = 1, 16, 64
    assert all("(gemv" in r or "(dot" in r for r in rows), rows  # the tuned w8a16 config per row
    # The FP8 x FP8 GEMM timed from 16 tokens (its config in its column), not at M = 1
    by_m = {int(r.split("|")[2]): r for r in rows}
    assert "(m64" in by_m[16] and "(m64" in by_m[64] and "(m64" not in by_m[1], rows
