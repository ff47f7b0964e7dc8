"""Embedding throughput of the fleet against the engine in process, on one GPU, in one run.

    python3 scripts/bench_embeddings_gpu.py --shape llama3-8b    # Llama-3-8B's shape, random bf16
    python3 scripts/bench_embeddings_gpu.py --shape bert-base    # BERT-base's shape, random weights
    .venv/bin/python scripts/bench_embeddings_gpu.py --shape tiny-bert --device cpu --num-chunks 200

The same --num-chunks (10,000) chunks of token ids (lengths uniform around --chunk-tokens) go
through (a) `LLMEngine.embed` in this process, warmed up; (b) a fleet (redis-server, a
`tokenfleet scheduler --runner pooling`, a gateway) through one Batch API job of
`/v1/embeddings` lines, from the file's upload to the job's end; (c) the same fleet through
`/v1/embeddings` calls of --inputs-per-call chunks from --concurrency clients, base64 as the
openai SDK asks. The fleet runs first, then it is stopped and (a) has the GPU to itself. Prints
one markdown table: inputs/s, tokens/s, and each fleet path's ratio to (a); every vector is
checked (shape, norm 1) and a wrong one counts as an error. The Batch API's items are batch
work: alone, the scheduler runs them in steps the cost model puts at ~50 ms (`--itl-target-ms
off`: whole budgets, as the engine in process runs them).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.config import EngineConfig  # noqa: E402
from testkit.embedding_runs import (  # noqa: E402
    SHAPES,
    Row,
    build_model,
    cpu_table,
    make_chunks,
    metered,
    run_batch_job,
    run_concurrent,
    run_engine,
    start_fleet,
    table,
)
from testkit.processes import Children  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-chunks", type=int, default=10_000)
    parser.add_argument("--chunk-tokens", type=int, default=256, help="mean tokens per chunk")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--inputs-per-call", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--gateway-workers", type=int, default=2)
    parser.add_argument("--batch-max-inflight", type=int, default=1024,
                        help="the gateway's: a job's lines queued at once")
    parser.add_argument("--itl-target-ms", default="auto",
                        help="the scheduler's: auto (batch items alone run in ~50 ms steps) "
                             "or off (whole budgets)")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads on a CPU device, for the scheduler and the engine in process "
                             "alike (default: torch's, one per core; on a few shared cores their "
                             "spinning shows up as the scheduler's CPU per input)")
    parser.add_argument("--paths", default="engine,batch,calls",
                        help="which to run, comma-separated: engine (in process), batch (the Batch "
                             "API job), calls (/v1/embeddings under concurrency)")
    args = parser.parse_args()
    paths = set(args.paths.split(","))
    if not paths or not paths <= {"engine", "batch", "calls"}:
        parser.error(f"--paths {args.paths!r}: choose among engine, batch, calls")
    print(" ".join(sys.argv), flush=True)
    work = Path(tempfile.mkdtemp(prefix="tokenfleet-bench-embed-"))
    folder = work / args.shape
    vocab, hidden = build_model(args.shape, folder, args.device)
    chunks = make_chunks(args.num_chunks, args.chunk_tokens, vocab)
    limits = ["--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    rows: list[Row] = []
    children = Children(work / "logs")
    try:
        engine_flags = ["--device", args.device, "--itl-target-ms", args.itl_target_ms, *limits]
        if args.num_threads is not None:
            engine_flags += ["--num-threads", str(args.num_threads)]
        if paths & {"batch", "calls"}:
            url, meter = start_fleet(children, folder, work, engine_flags,
                                     ["--workers", str(args.gateway_workers),
                                      "--batch-max-inflight", str(args.batch_max_inflight)])
            run_concurrent(url, make_chunks(64, args.chunk_tokens, vocab, seed=1), hidden, 8, 8)  # warm-up
        if "batch" in paths:
            rows.append(metered(meter, lambda: run_batch_job(url, chunks, hidden)))
        if "calls" in paths:
            others = make_chunks(args.num_chunks, args.chunk_tokens, vocab, seed=2)  # not in any cache
            rows.append(metered(meter, lambda: run_concurrent(url, others, hidden, args.concurrency,
                                                              args.inputs_per_call)))
    except Exception as exc:  # noqa: BLE001 - a failed path is a row saying so
        rows.append(Row("fleet", errors=[f"{type(exc).__name__}: {exc}"]))
        print(children.tail("scheduler"), children.tail("gateway"), sep="\n", file=sys.stderr)
    finally:
        children.stop()
    config = EngineConfig.for_device(args.device.split(":")[0], model=str(folder), device=args.device,
                                     runner="pooling", max_num_seqs=args.max_num_seqs,
                                     max_num_batched_tokens=args.max_num_batched_tokens,
                                     num_threads=args.num_threads)
    baseline = run_engine(config, chunks, hidden) if "engine" in paths else None
    print(f"\n{args.shape}, {args.num_chunks} chunks of ~{args.chunk_tokens} tokens, device {args.device}\n")
    every = [baseline, *rows] if baseline is not None else rows
    print(table(every, baseline))
    print()
    print(cpu_table(every))
    return 0


if __name__ == "__main__":
    sys.exit(main())
