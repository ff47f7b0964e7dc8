"""Tensor parallelism over two GPUs with NCCL, in one call on a two-GPU machine.

    python3 scripts/bench_tp.py                                  # 2 GPUs: Qwen2-7B shape, ~5 min
    python3 scripts/bench_tp.py --smoke --device cpu --dtype float32   # tiny model, gloo: checks the script

Builds a Qwen2-7B-shaped checkpoint (hidden 3584, 28 layers, 28 heads, 4 KV heads,
intermediate 18944, vocab 152064, q/k/v biases) with random bf16 weights, saves it as
safetensors, and then, each measurement in the same run:
1. the per-rank weight budget: max_weight_bytes_per_rank at 60% of the whole model's weights
   refuses TP=1 (before any weight is allocated) and serves at TP=2;
2. greedy tokens of TP=2 against TP=1 for 32 tokens over --num-prompts prompts (match rate);
3. weights and memory per GPU (each rank's torch.cuda.memory_allocated);
4. throughput at TP=1 and TP=2 on a smaller version of the bench workload (scripts/bench_gpu.py);
5. the share of TP=2 step time spent in collectives: CUDA events around every all-reduce and
   all-gather on rank 0 (EngineConfig.time_collectives; those steps run eagerly).

TP=2 runs through the Ray worker group when Ray is installed, else (--executor mp) through
plain processes, one RankWorker each, with the same NCCL code path. NVLink multicast stays off
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1), set here
before anything starts and passed on to every rank. Embeddings and LM head are drawn with std
0.1 (the rest 0.02) so that greedy choices are not near-ties that bf16 rounding flips.
Prints the command line first and one markdown table last; a failed step is a row, not the end.
"""

from __future__ import annotations

import os

import bench_common  # noqa: F401 - first: it puts the repository on sys.path (and imports no torch)

from shared.config import MULTICAST_OFF_ENV

os.environ.update(MULTICAST_OFF_ENV)  # before torch, NCCL or Ray start

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import multiprocessing as mp  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

# bench_common before the product: importing it puts the repository on sys.path.
from bench_common import (  # noqa: E402
    Interrupted,
    Workload,
    checkpoint_folder,
    log,
    module_bytes,
    print_command,
    random_model,
    run_engine_workload,
    sharegpt_workload,
    start_local_ray,
    stop_on_sigterm,
)

import scheduler.engine as engine_module  # noqa: E402
from scheduler.engine import LLMEngine  # noqa: E402
from shared.config import EngineConfig  # noqa: E402
from shared.errors import ModelLoadError, WorkerError  # noqa: E402
from shared.logging import configure_logging  # noqa: E402
from shared.net import free_port  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from shared.step import StepBatch, StepResult  # noqa: E402
from workers.model_runner import format_bytes  # noqa: E402
from workers.rank_worker import RankWorker  # noqa: E402

QWEN2_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                intermediate_size=18944, vocab_size=152064, max_position_embeddings=8192,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY_QWEN2 = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512, max_position_embeddings=2048,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
MATRIX_STD, EMBEDDING_STD = 0.02, 0.1
BUDGET_FRACTION = 0.6
STARTUP_TIMEOUT_S = 600.0


# -- the checkpoint -----------------------------------------------------------------------------


def build_checkpoint(shape: dict, device: torch.device, folder: Path) -> tuple[int, int]:
    """Write a random Qwen2 checkpoint; returns (parameters, weight bytes in bf16)."""
    from transformers import Qwen2Config

    model = random_model(Qwen2Config(**shape, use_sliding_window=False), device, std=MATRIX_STD,
                         embedding_std=EMBEDDING_STD)
    model.save_pretrained(folder)
    num_params = sum(p.numel() for p in model.parameters())
    weight_bytes = module_bytes(model)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return num_params, weight_bytes


# -- TP=2 without Ray: one process per rank, each a RankWorker ----------------------------------


def _rank_main(config: EngineConfig, rank: int, port: int, conn) -> None:
    """A rank's process: load, then serve the driver's calls until "shutdown" or a closed pipe."""
    os.environ.update(MULTICAST_OFF_ENV)
    worker = RankWorker(config, rank)
    try:
        conn.send(("ok", worker.load("127.0.0.1", port)))
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            break
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except Exception as exc:  # noqa: BLE001
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))
        if method == "shutdown":
            break


class ProcessGroup:
    """The Executor protocol over spawned processes (the fallback when Ray is not installed)."""

    pipeline_depth = 1  # one step at a time: submit runs it, collect hands its result back

    def __init__(self, config: EngineConfig) -> None:
        if resolve_cpu(config):
            config = dataclasses.replace(config, num_threads=max(1, (os.cpu_count() or 2) // config.tp))
        self.config = config
        self.step_timeout_s = config.step_timeout_s
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns, self.procs = [], []
        for rank in range(config.tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(config, rank, port, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        try:
            self.infos = [self._receive(rank, STARTUP_TIMEOUT_S) for rank in range(config.tp)]
        except WorkerError as exc:
            self.shutdown()
            raise ModelLoadError(str(exc)) from None
        self.num_kv_blocks = min(info.num_kv_blocks for info in self.infos)
        self.max_model_len = self.infos[0].max_model_len
        self.block_size = self.infos[0].block_size

    def _receive(self, rank: int, timeout: float):
        conn = self.conns[rank]
        if not conn.poll(timeout):
            raise WorkerError(f"rank {rank} did not answer within {timeout:.0f} s")
        try:
            kind, payload = conn.recv()
        except EOFError:
            raise WorkerError(f"rank {rank} died (exit code {self.procs[rank].exitcode})") from None
        if kind == "error":
            raise WorkerError(f"rank {rank}: {payload}")
        return payload

    def call_all(self, method: str, *args, timeout: float | None = None) -> list:
        for conn in self.conns:
            conn.send((method, args))
        return [self._receive(rank, timeout or self.step_timeout_s) for rank in range(len(self.conns))]

    def execute(self, batch: StepBatch) -> StepResult:
        return self.call_all("execute", batch)[0]

    submit = execute

    def collect(self, handle: StepResult) -> StepResult:
        return handle

    def restart(self) -> None:
        raise WorkerError("this benchmark's process group does not restart")

    def rank_weight_bytes(self) -> list[int]:
        return [info.weight_bytes for info in self.infos]

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("shutdown", ()))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        self.conns, self.procs = [], []


def resolve_cpu(config: EngineConfig) -> bool:
    return (config.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")


def rank_calls(engine: LLMEngine, method: str) -> list:
    """Call a RankWorker method on every rank of the engine's group (Ray or processes)."""
    executor = engine.executor
    if isinstance(executor, ProcessGroup):
        return executor.call_all(method)
    import ray

    return ray.get([getattr(actor, method).remote() for actor in executor.actors], timeout=120)


def make_engine(config: EngineConfig, executor: str) -> LLMEngine:
    if config.tp > 1 and executor == "mp":
        original = engine_module.make_executor
        engine_module.make_executor = ProcessGroup
        try:
            return LLMEngine(config, load_tokenizer_files=False)
        finally:
            engine_module.make_executor = original
    return LLMEngine(config, load_tokenizer_files=False)


# -- the measurements -----------------------------------------------------------------------


def greedy_tokens(engine: LLMEngine, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    return [r.token_ids for r in engine.generate(prompts, greedy)]


def match_summary(ours: list[list[int]], reference: list[list[int]]) -> str:
    prefixes = []
    for a, b in zip(ours, reference, strict=True):
        first_difference = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        prefixes.append(next(first_difference, min(len(a), len(b))))
    full = sum(p == len(r) for p, r in zip(prefixes, reference, strict=True))
    return (f"{full}/{len(reference)} prompts identical for all {len(reference[0])} tokens; mean matching "
            f"prefix {sum(prefixes) / len(prefixes):.1f} tokens")


def serve(name: str, config: EngineConfig, executor: str, prompts: list[list[int]], num_tokens: int,
          workload: Workload, rows: list[tuple[str, str, str]], device: torch.device) -> dict:
    """Load an engine, take greedy tokens, memory and throughput; rows for whatever worked."""
    found: dict = {}
    start = time.perf_counter()
    engine = None
    try:
        engine = make_engine(config, executor)
        found["load_s"] = time.perf_counter() - start
        if config.tp > 1:
            found["graph_sizes"] = rank_calls(engine, "decode_graph_sizes")
            found["memory"] = rank_calls(engine, "memory")
        else:
            runner = engine.executor.runner
            found["graph_sizes"] = [runner.decode_graphs.sizes if runner.decode_graphs else []]
            allocated = torch.cuda.memory_allocated(runner.device) if device.type == "cuda" else 0
            found["memory"] = [dict(rank=0, weight_bytes=runner.weight_bytes,
                                    kv_cache_bytes=runner.kv_cache_bytes, allocated_bytes=allocated)]
        log(f"{name}: loaded in {found['load_s']:.0f} s; CUDA graphs per rank: "
            f"{[len(s) for s in found['graph_sizes']]}")
        found["greedy"] = greedy_tokens(engine, prompts, num_tokens)
        run = run_engine_workload(engine, workload, 240.0, device)
        found["rate"] = (run.output_rate, run.total_rate, run.seconds, run.notes)
        log(f"{name}: {run.output_rate:,.0f} output tok/s")
    except Exception as exc:  # noqa: BLE001 - a failed step is a row
        traceback.print_exc()
        first_line = str(exc).splitlines()[0][:300] if str(exc) else ""
        rows.append((name, f"FAILED: {type(exc).__name__}", first_line))
    finally:
        if engine is not None:
            engine.close()
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return found


def collective_share(config: EngineConfig, executor: str, workload: Workload,
                     device: torch.device) -> tuple[str, str]:
    engine = make_engine(dataclasses.replace(config, time_collectives=True, cuda_graphs=False), executor)
    try:
        rank_calls(engine, "collective_times")  # forget the warm-up and load
        run = run_engine_workload(engine, workload, 120.0, device)
        times = rank_calls(engine, "collective_times")
    finally:
        engine.close()
    rank0 = times[0]
    if not rank0.step_ms:
        return "n/a", "no CUDA events (not on CUDA)"
    share = rank0.collective_ms / rank0.step_ms
    per_step = rank0.num_collectives / max(rank0.num_steps, 1)
    mean_us = rank0.collective_ms / max(rank0.num_collectives, 1) * 1e3
    return (f"{share:.1%} of step time",
            f"rank 0, {rank0.num_steps} eager steps ({len(workload.prompts)} requests, "
            f"{run.output_rate:,.0f} output tok/s): {rank0.collective_ms / 1e3:.2f} s of "
            f"{rank0.step_ms / 1e3:.2f} s GPU step time in {rank0.num_collectives} collectives "
            f"({per_step:.0f} a step, {mean_us:.0f} us each, waits for the other rank included); "
            f"rank 1: {times[1].collective_ms / max(times[1].step_ms, 1e-9):.1%}")


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--smoke", action="store_true", help="tiny model and workload (checks the script)")
    parser.add_argument("--executor", choices=("auto", "ray", "mp"), default="auto",
                        help="TP=2 through Ray (auto: when installed) or plain processes")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--num-tokens", type=int, default=32)
    parser.add_argument("--num-requests", type=int,
                        help="requests of the throughput workload (default 200; 16 with --smoke)")
    parser.add_argument("--num-timed-requests", type=int, default=48,
                        help="requests of the all-reduce timing run")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print_command()
    configure_logging("WARNING")
    device = torch.device(args.device)
    executor = args.executor
    if executor == "auto":
        executor = "ray" if importlib.util.find_spec("ray") is not None else "mp"
    num_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    log(f"torch {torch.__version__}, {num_gpus} GPUs, executor {executor}, "
        f"{ {k: os.environ[k] for k in MULTICAST_OFF_ENV} }")
    if device.type == "cuda" and num_gpus < 2:
        raise SystemExit(f"TP=2 needs two GPUs; this machine has {num_gpus}")
    if executor == "ray":
        start_local_ray(MULTICAST_OFF_ENV)

    shape = TINY_QWEN2 if args.smoke else QWEN2_7B
    how = ("Ray worker group" if executor == "ray"
           else "one spawned process per rank, each a RankWorker (Ray not installed)")
    rows: list[tuple[str, str, str]] = [("executor for TP=2", executor, how)]
    folder = checkpoint_folder(15 << 30 if not args.smoke else 1 << 20)
    stop_on_sigterm()
    num_params = 0
    try:
        num_params, checkpoint_bytes = build_checkpoint(shape, device, folder)
        log(f"checkpoint: {num_params / 1e9:.2f} B parameters, {checkpoint_bytes / 1e9:.2f} GB in {folder}")
        # The whole model's weights in the serving dtype: what TP=1 would hold.
        full_bytes = num_params * torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
        run_all(args, folder, full_bytes, shape, executor, device, rows)
    except Interrupted:
        rows.append(("INTERRUPTED", "SIGTERM", "the rows above are what finished"))
    except Exception as exc:  # noqa: BLE001 - the rows so far are still printed
        traceback.print_exc()
        rows.append(("building the checkpoint", f"FAILED: {type(exc).__name__}", str(exc)[:300]))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    log("done")
    where = torch.cuda.get_device_name() if num_gpus else "cpu"
    print(f"\n{'SMOKE RUN, not a measurement: ' if args.smoke else ''}TP=2 vs TP=1, Qwen2-7B shape "
          f"({num_params / 1e9:.2f} B params, {args.dtype}), {where}\n")
    print("| check | result | notes |")
    print("| --- | --- | --- |")
    for name, result, notes in rows:
        print(f"| {name} | {result} | {notes} |")


def run_all(args, folder: Path, full_bytes: int, shape: dict, executor: str, device: torch.device,
            rows: list[tuple[str, str, str]]) -> None:
    budget = int(BUDGET_FRACTION * full_bytes)
    # A failed or hung step ends that measurement at once instead of rebuilding the group.
    base = dict(model=str(folder), device=args.device, dtype=args.dtype, max_num_seqs=256,
                max_num_batched_tokens=8192, cuda_graphs=not args.no_cuda_graphs, step_timeout_s=60.0,
                max_group_restarts=0)
    rng = random.Random(3)
    longest = 64 if args.smoke else 512
    prompts = [[rng.randrange(shape["vocab_size"]) for _ in range(rng.randint(16, longest))]
               for _ in range(args.num_prompts)]
    workload = sharegpt_workload(args.num_requests or (16 if args.smoke else 200), shape["vocab_size"],
                                 prompt_max=200 if args.smoke else 1024, output_max=32 if args.smoke else 512)

    # 1. The budget at TP=1: refused before any weight is allocated.
    start = time.perf_counter()
    try:
        make_engine(EngineConfig(**base, max_weight_bytes_per_rank=budget), executor).close()
        rows.append(("budget 60% of the weights, TP=1", "NOT refused (wrong)",
                     f"budget {format_bytes(budget)}"))
    except ModelLoadError as exc:
        rows.append(("budget 60% of the weights, TP=1", f"refused in {time.perf_counter() - start:.1f} s",
                     f"ModelLoadError: {exc}"))

    tp1 = serve("TP=1", EngineConfig(**base), executor, prompts, args.num_tokens, workload, rows, device)
    tp2_config = EngineConfig(**base, tp=2, use_ray=executor == "ray", max_weight_bytes_per_rank=budget)
    tp2 = serve("TP=2", tp2_config, executor, prompts, args.num_tokens, workload, rows, device)
    if "greedy" not in tp2 and not args.no_cuda_graphs:  # e.g. a capture problem with NCCL: try eagerly
        log("TP=2 failed with CUDA graphs; again without them")
        tp2_config = dataclasses.replace(tp2_config, cuda_graphs=False)
        tp2 = serve("TP=2 (no CUDA graphs)", tp2_config, executor, prompts, args.num_tokens, workload, rows,
                    device)
    if "greedy" in tp2:
        rows.append(("budget 60% of the weights, TP=2", "loaded and served",
                     f"max_weight_bytes_per_rank {format_bytes(budget)}; {args.num_prompts} prompts and "
                     f"{len(workload.prompts)} requests served"))
    if "greedy" in tp1 and "greedy" in tp2:
        rows.append((f"greedy TP=2 vs TP=1 ({args.num_tokens} tokens)",
                     match_summary(tp2["greedy"], tp1["greedy"]),
                     f"{args.num_prompts} random prompts of 16-{longest} tokens, {args.dtype}"))
    memory_rows(tp1, tp2, full_bytes, rows)
    for name, found in (("TP=1", tp1), ("TP=2", tp2)):
        if "rate" in found:
            out, total, seconds, notes = found["rate"]
            graphs = "CUDA graphs" if all(found["graph_sizes"]) else "eager"
            rows.append((f"throughput {name}", f"{out:,.0f} output tok/s, {total:,.0f} total tok/s",
                         f"{seconds:.1f} s, {graphs}; {notes}"))
    if "rate" in tp1 and "rate" in tp2:
        rows.append(("throughput TP=2 / TP=1", f"{tp2['rate'][0] / tp1['rate'][0]:.2f}x", "output tokens/s"))
    if not args.skip_timing:
        try:
            timed_config = dataclasses.replace(tp2_config, max_weight_bytes_per_rank=None)
            timed_workload = workload.head(args.num_timed_requests)
            share, notes = collective_share(timed_config, executor, timed_workload, device)
            rows.append(("all-reduce share of TP=2 step time", share, notes))
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            rows.append(("all-reduce share of TP=2 step time", f"FAILED: {type(exc).__name__}",
                         str(exc)[:300]))


def memory_rows(tp1: dict, tp2: dict, full_bytes: int, rows: list[tuple[str, str, str]]) -> None:
    def field(m, name):
        return m[name] if isinstance(m, dict) else getattr(m, name)

    for name, found in (("TP=1", tp1), ("TP=2", tp2)):
        if "memory" not in found:
            continue
        parts, notes = [], []
        for m in found["memory"]:
            weights = field(m, "weight_bytes")
            parts.append(f"rank {field(m, 'rank')}: {format_bytes(weights)} weights "
                         f"({weights / full_bytes:.1%})")
            notes.append(f"rank {field(m, 'rank')}: {format_bytes(field(m, 'allocated_bytes'))} allocated "
                         f"({format_bytes(field(m, 'kv_cache_bytes'))} KV cache)")
        rows.append((f"memory per GPU, {name}", "; ".join(parts),
                     "torch.cuda.memory_allocated: " + "; ".join(notes)))


if __name__ == "__main__":
    main()
