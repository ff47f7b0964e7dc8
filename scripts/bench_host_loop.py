"""The engine loop's host time per step with the model taken out, before and after the garbage
collector is tuned as a serving process tunes it (shared/gc_tuning.py), in one run. Run by hand:

    .venv/bin/python scripts/bench_host_loop.py [--num-requests 500] [--repeats 3]

The engine is the real LLMEngine (scheduler, block manager, async scheduling) over a tiny random
llama, but its executor samples token 5 for every sampled work without running a model: what is
left is what the engine thread does per step on the host (schedule, make the works, take the
tokens back, stop checks). Workload: the GPU burst's ShareGPT-like lengths, all at once, EOS
ignored. Each configuration runs --repeats times; the median is reported. The engine holds the
tuning from its start, so the baseline releases it first.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path

from scheduler.engine import LLMEngine
from shared import gc_tuning
from shared.config import EngineConfig
from testkit.checkpoints import SMOLLM2_VOCAB_SIZE, tiny_llama_with_smollm2_tokenizer
from testkit.host_loop import SamplingOnlyExecutor, run_burst
from testkit.runs import print_command
from testkit.workloads import sharegpt_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print_command()
    workload = sharegpt_workload(args.num_requests, SMOLLM2_VOCAB_SIZE)
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_llama_with_smollm2_tokenizer(Path(tmp) / "model", max_position_embeddings=4096)
        config = EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=60_000, max_num_seqs=512,
                              max_num_batched_tokens=8192, async_scheduling=True)
        with LLMEngine(config, load_tokenizer_files=False) as engine:
            fake = SamplingOnlyExecutor()
            engine.executor.submit, engine.executor.collect = fake.submit, fake.collect
            run_burst(engine, workload)  # warm-up
            rows = {}
            for label in ("collector as Python starts it (baseline)", "tuned for serving"):
                if label == "tuned for serving":
                    gc_tuning.hold()
                else:
                    gc_tuning.release()  # the engine holds the tuning from its start: take it off
                runs = [run_burst(engine, workload) for _ in range(args.repeats)]
                seconds = statistics.median(s for s, _ in runs)
                rows[label] = (seconds, runs[0][1])
    baseline = next(iter(rows.values()))[0]
    print(f"\n{args.num_requests} requests ({workload.num_output_tokens:,} output tokens), no model, "
          f"median of {args.repeats}\n")
    print("| garbage collector | steps | host ms per step | vs baseline |\n| --- | ---: | ---: | ---: |")
    for label, (seconds, steps) in rows.items():
        print(f"| {label} | {steps} | {1e3 * seconds / steps:.2f} | {seconds / baseline:.2f}x |")


if __name__ == "__main__":
    main()
