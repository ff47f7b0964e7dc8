"""Where a process's time goes, from a py-spy raw profile (`py-spy record -f raw --threads
--subprocesses`): per process and thread, the share of samples in each named bucket.

    python -m testkit.spy_summary serve48_scheduler.txt

A line of the raw format is `frame;frame;...;frame COUNT`, outermost first; with --threads
and --subprocesses the first frames name the process and the thread. A sample goes to the
first bucket whose pattern appears in any of its frames, checked in the order below (so "GPU
wait" wins over the step that waits).
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    ("idle: waiting on Redis or a pipe", ("xreadgroup", "_read_pipe", "poll (multiprocessing", "recv (",
                                          "wait (threading", "get (queue", "select", "read_response")),
    ("GPU wait (host sync)", ("tolist", "synchronize", "item (", "_sync")),
    ("model launch", ("forward (workers", "run (workers/mixed_graphs", "run (workers/cuda_graphs",
                      "JITFunction", "_matmul", "compute_logits", "replay")),
    ("sampling", ("sample (workers/sampler",)),
    ("step inputs", ("step_inputs", "attention_metadata")),
    ("scheduling", ("schedule (scheduler", "update_from_output", "_make_work")),
    ("detokenize", ("detokenizer",)),
    ("build and pack records", ("step_update", "pack (service", "encode (protocol", "packb")),
    ("Redis write", ("write_packed", "execute_command", "_write (service")),
    ("admission", ("_admit", "claim_many", "add_request")),
    ("hand over to the publisher", ("submit_step", "_send (service", "send (multiprocessing")),
]


def summarize(path: Path) -> dict[str, collections.Counter]:
    per_thread: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        where = ";".join(f for f in frames[:2] if f.startswith(("process", "thread")))
        per_thread[where or "?"][_bucket(frames)] += int(count)
    return per_thread


def _bucket(frames: list[str]) -> str:
    for name, patterns in BUCKETS:
        if any(p in frame for frame in frames for p in patterns):
            return name
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs="+", type=Path)
    parser.add_argument("--min-share", type=float, default=0.02, help="threads below this share are left out")
    args = parser.parse_args()
    for path in args.profiles:
        per_thread = summarize(path)
        total = sum(sum(c.values()) for c in per_thread.values())
        print(f"## {path.name}: {total} samples")
        for where, counter in sorted(per_thread.items(), key=lambda kv: -sum(kv[1].values())):
            n = sum(counter.values())
            if n < args.min_share * total:
                continue
            label = re.sub(r"\s+", " ", where)
            print(f"{label}: {n} samples")
            for name, k in counter.most_common():
                print(f"  {100 * k / n:5.1f}%  {name}")


if __name__ == "__main__":
    main()
