"""Speculative decoding (n-gram, or --draft-model PATH) against plain decoding, SmolLM2's weights.

    nice -n 19 .venv/bin/python scripts/bench_spec.py --num-threads 1  # this CPU (float32)
    python3 scripts/bench_spec.py --device cuda                        # a GPU (bfloat16)
    python3 scripts/bench_spec.py --device cuda --dtype float32        # a GPU, exact greedy identity
    .venv/bin/python scripts/bench_spec.py --smoke                     # a quick check of the script

Two engines with the same settings, one with --speculative-config (--spec), are built and warmed
up on every workload (short); each workload of testkit/spec_runs.py (copy and chat at batch 1, a
batch of --batch requests) runs on the plain one then the speculating one. The table gives, per
workload, a row for each engine: output tokens per second, the ratio, the steps and the share of
them that speculated (steps with drafts, look-ups per step), the requests the expected-gain rule
turned off, the drafts' acceptance, and whether every output is token-identical (greedy). The
script exits non-zero when an output differs.
"""

from __future__ import annotations

import argparse
import sys

import _repo  # noqa: F401 - first: it puts the repository on sys.path

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.logging import configure_logging
from testkit.runs import log, print_command
from testkit.spec_runs import compare_row, print_rows, prompts_of, spec_config, warm_up
from workers.default_model import fetch_default_model
from workers.device import resolve_device

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu (in bfloat16 a verify "
                        "step's products may round a near-tie otherwise than a decode's)")
    parser.add_argument("--spec", default=SPEC, help="the --speculative-config of the speculating engine")
    parser.add_argument("--draft-model", metavar="PATH", help="a draft model speculates (same tokenizer)")
    parser.add_argument("--max-tokens", type=int, default=256, help="per request at batch 1")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batch-max-tokens", type=int, default=64)
    parser.add_argument("--num-threads", type=int, help="torch threads on CPU (default: torch's)")
    parser.add_argument("--num-kv-blocks", type=int, default=1024,
                        help="per engine (two live at once; sized from memory, the first takes it all)")
    parser.add_argument("--smoke", action="store_true", help="16 tokens, a batch of 4")
    args = parser.parse_args()
    if args.smoke:
        args.max_tokens, args.batch, args.batch_max_tokens = 16, 4, 8
    print_command()
    configure_logging(level="WARNING")
    model = args.model or str(fetch_default_model())
    device = resolve_device(args.device)
    engines = {}
    for name, spec in (("plain", None), ("ngram", spec_config(args))):
        config = EngineConfig.for_device(device.type, model=model, device=args.device, dtype=args.dtype,
                                         max_num_seqs=max(args.batch, 8), num_threads=args.num_threads,
                                         num_kv_blocks=args.num_kv_blocks,
                                         speculative_config=spec)
        engines[name] = LLMEngine(config)
        warm_up(engines[name], args.batch)
        log(f"{name} engine ready")
    rows = []
    for workload, max_tokens, alone in (("copy", args.max_tokens, True), ("chat", args.max_tokens, True),
                                        ("batch", args.batch_max_tokens, False)):
        prompts = prompts_of(engines["plain"], workload, args.batch)
        rows.append(compare_row(engines["plain"], engines["ngram"], workload, prompts, max_tokens, alone))
        log(f"{rows[-1].label}: done")
    print(f"\nSmolLM2 on {device}; speculative config {args.spec}")
    print("(ratio: spec / plain output tok/s; by CPU: the same in output tokens per CPU second of this "
          "process; cores: the smaller of the two runs' CPU seconds per wall second; ahead: steps whose "
          "successor was planned while they ran (async scheduling); verify: steps with drafts; lookups: "
          "look-ups for drafts per step, found or not, each a step with none planned ahead (at batch 1, "
          "the share of steps that speculated); backoffs: requests the expected-gain rule turned off)")
    print_rows(rows, spec.method)
    is_identical = all(row.is_identical for row in rows)
    for engine in engines.values():
        engine.close()
    return 0 if is_identical else 1


if __name__ == "__main__":
    sys.exit(main())
