"""Per-step dispatch overhead of worker groups, and the TP=2 / TP=1 throughput ratio.

Run by hand (not a test); prints one table, the baseline measured in the same run:

    .venv/bin/python scripts/bench_dispatch.py [--steps 300] [--skip-throughput]

Dispatch: a decode step of one token on a one-layer tiny model (almost no compute), timed
in-process (the baseline: no transport at all), then through a Ray group with plain actor
calls and with a Ray Compiled Graph, and the compiled graph's transport alone (ranks that
return at once). Overhead = group median - in-process median; at TP=2 a real step also
pays the layer's gloo all-reduces, which the no-op row leaves out.
Throughput: SmolLM2 greedy, 16 requests of 64 prompt and 64 output tokens, TP=1 and TP=2
groups (on this 2-core CPU TP=2 pays two gloo all-reduces per layer: it is for
correctness here, not speed).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path
import ray

from testkit.checkpoints import make_tiny_checkpoint
from testkit.dispatch_runs import measure_dispatch, measure_throughput
from testkit.runs import print_command


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    print_command()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_checkpoint("llama", Path(tmp) / "tiny", num_hidden_layers=1)
        rows = measure_dispatch(folder, args.steps)
    baseline = rows[0][1]
    print("\n| dispatch of an almost-empty step | median ms | overhead over in-process, ms |")
    print("| --- | --- | --- |")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e3:.3f} | {(seconds - baseline) * 1e3:.3f} |")
    if not args.skip_throughput:
        from workers.default_model import fetch_default_model

        model = str(fetch_default_model())
        tp1, tp2 = measure_throughput(1, model), measure_throughput(2, model)
        print("\n| SmolLM2 greedy, 16 x (64 in, 64 out), float32 | output tok/s |")
        print("| --- | --- |")
        print(f"| TP=1 (Ray group) | {tp1:.1f} |")
        print(f"| TP=2 (Ray group, gloo) | {tp2:.1f} |")
        print(f"| TP=2 / TP=1 | {tp2 / tp1:.2f} |")


if __name__ == "__main__":
    main()
