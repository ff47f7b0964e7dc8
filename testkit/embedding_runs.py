"""What scripts/bench_embeddings_gpu.py times: the same chunks embedded (a) by the engine in
this process, (b) by a fleet through a Batch API job of `/v1/embeddings` lines, (c) by a fleet
through `/v1/embeddings` calls under concurrency. Each gives a Row (inputs, tokens, seconds,
errors); every vector is checked (its length, its norm) so an empty answer is no speedup.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from testkit.checkpoints import (
    add_tiny_wordpiece_tokenizer,
    make_tiny_bert,
    tiny_llama_with_smollm2_tokenizer,
)
from testkit.processes import Children, CpuMeter, start_gateway, start_redis, start_scheduler

MODEL_NAME = "bench-embed"
BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                 vocab_size=30522, max_position_embeddings=512)
SHAPES = ("llama3-8b", "bert-base", "tiny-llama", "tiny-bert")


@dataclass
class Row:
    path: str
    num_inputs: int = 0
    num_tokens: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    # CPU seconds each process spent on the path (a fleet's: redis, scheduler, gateway, each with
    # its children): where the per-input host cost is when the engine is not the limit
    cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def inputs_per_s(self) -> float:
        return self.num_inputs / self.seconds if self.seconds else 0.0


def build_model(shape: str, folder: Path, device: str) -> tuple[int, int]:
    """Write the `shape` checkpoint (random weights, a tokenizer) into folder; returns (vocab size,
    hidden size)."""
    folder.mkdir(parents=True, exist_ok=True)
    if shape == "llama3-8b":
        import torch

        from testkit.checkpoints import SMOLLM2_VOCAB_SIZE
        from testkit.random_models import write_llama3_8b_with_smollm2_tokenizer

        write_llama3_8b_with_smollm2_tokenizer(folder, torch.device(device))
        return SMOLLM2_VOCAB_SIZE, 4096
    if shape == "tiny-llama":
        tiny_llama_with_smollm2_tokenizer(folder, max_position_embeddings=2048)
        return 49152, 64
    fields = BERT_BASE if shape == "bert-base" else {"max_position_embeddings": 512}
    make_tiny_bert(folder, **fields)
    add_tiny_wordpiece_tokenizer(folder, vocab_size=fields.get("vocab_size", 512))
    return fields.get("vocab_size", 512), fields.get("hidden_size", 64)


def make_chunks(num_chunks: int, mean_tokens: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """RAG-like chunks as token ids: lengths uniform in [mean/2, 3*mean/2], ids random (past the
    first 1,000, clear of special tokens)."""
    rng = random.Random(seed)
    low, high = max(1, mean_tokens // 2), max(1, mean_tokens * 3 // 2)
    return [[rng.randrange(min(1000, vocab_size // 2), vocab_size) for _ in range(rng.randint(low, high))]
            for _ in range(num_chunks)]


def check_vector(vector: np.ndarray, hidden: int) -> str | None:
    if vector.shape != (hidden,) or not np.isfinite(vector).all() or abs(np.linalg.norm(vector) - 1) > 1e-2:
        return f"a vector of shape {vector.shape}, norm {float(np.linalg.norm(vector)):.3f}"
    return None


def run_engine(config: EngineConfig, chunks: list[list[int]], hidden: int) -> Row:
    """(a): LLMEngine in this process, warmed up, every chunk added at once."""
    row = Row("engine in process")
    with LLMEngine(config) as engine:
        engine.warm_up()
        meter = CpuMeter({"engine": os.getpid()})
        meter.start()
        started = time.perf_counter()
        results = engine.embed(chunks)
        row.seconds = time.perf_counter() - started
        row.cpu_s = meter.stop()
    row.num_inputs, row.num_tokens = len(results), sum(r.num_prompt_tokens for r in results)
    row.errors = [e for e in (check_vector(r.embedding, hidden) for r in results) if e]
    return row


def start_fleet(children: Children, folder: Path, work_dir: Path, engine_flags: list[str],
                gateway_flags: list[str]) -> tuple[str, CpuMeter]:
    """Redis, a `tokenfleet scheduler --runner pooling`, a gateway; returns the gateway's URL and
    a meter of the three processes' CPU time (each with its children)."""
    redis_url, _ = start_redis(children, work_dir / "redis", appendfsync="everysec")
    start_scheduler(children, redis_url, folder, "--runner", "pooling", "--model-name", MODEL_NAME,
                    *engine_flags, scheduler_id="bench-embed-0", ready_s=900.0)
    url, _ = start_gateway(children, redis_url, folder, "--model-name", MODEL_NAME, *gateway_flags)
    return url, CpuMeter({name: children.pid(name) for name in ("redis-server", "scheduler", "gateway")})


def _vector(item: dict) -> np.ndarray:
    value = item["embedding"]
    if isinstance(value, str):
        return np.frombuffer(base64.b64decode(value), dtype=np.float32)
    return np.asarray(value, dtype=np.float32)


async def _batch_job(url: str, chunks: list[list[int]], hidden: int, poll_s: float) -> Row:
    row = Row("fleet: Batch API job")
    lines = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings",
                                "body": {"model": MODEL_NAME, "input": chunk,
                                         "encoding_format": "base64"}}) + "\n"
                    for i, chunk in enumerate(chunks))
    async with aiohttp.ClientSession() as session:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", lines.encode(), filename="chunks.jsonl", content_type="application/jsonl")
        started = time.perf_counter()
        async with session.post(f"{url}/v1/files", data=form) as response:
            file_id = (await response.json())["id"]
        create = {"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"}
        async with session.post(f"{url}/v1/batches", json=create) as response:
            batch = await response.json()
        while batch.get("status") not in ("completed", "failed", "expired", "cancelled"):
            await asyncio.sleep(poll_s)
            async with session.get(f"{url}/v1/batches/{batch['id']}") as response:
                batch = await response.json()
        row.seconds = time.perf_counter() - started
        if batch["status"] != "completed":
            row.errors.append(f"the job ended {batch['status']}: {batch.get('errors')}")
            return row
        async with session.get(f"{url}/v1/files/{batch['output_file_id']}/content") as response:
            output = await response.text()
    for line in output.splitlines():
        body = (json.loads(line).get("response") or {}).get("body") or {}
        if "data" not in body:
            row.errors.append(line[:200])
            continue
        row.num_inputs += 1
        row.num_tokens += body["usage"]["prompt_tokens"]
        if (problem := check_vector(_vector(body["data"][0]), hidden)) is not None:
            row.errors.append(problem)
    if row.num_inputs != len(chunks):
        row.errors.append(f"{row.num_inputs} of {len(chunks)} lines answered")
    return row


def run_batch_job(url: str, chunks: list[list[int]], hidden: int, poll_s: float = 0.2) -> Row:
    """(b): one Batch API job, a /v1/embeddings line per chunk; from the upload to the job's end."""
    return asyncio.run(_batch_job(url, chunks, hidden, poll_s))


async def _concurrent(url: str, chunks: list[list[int]], hidden: int, concurrency: int,
                      per_request: int) -> Row:
    row = Row(f"fleet: /v1/embeddings x{concurrency}")
    calls = [chunks[i:i + per_request] for i in range(0, len(chunks), per_request)]
    queue: asyncio.Queue = asyncio.Queue()
    for call in calls:
        queue.put_nowait(call)

    async def client(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            inputs = queue.get_nowait()
            async with session.post(f"{url}/v1/embeddings", json={"model": MODEL_NAME, "input": inputs,
                                                                   "encoding_format": "base64"}) as response:
                body = await response.json()
            if response.status != 200:
                row.errors.append(str(body)[:200])
                continue
            row.num_inputs += len(body["data"])
            row.num_tokens += body["usage"]["prompt_tokens"]
            row.errors += [e for e in (check_vector(_vector(item), hidden) for item in body["data"]) if e]

    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        row.seconds = time.perf_counter() - started
    return row


def run_concurrent(url: str, chunks: list[list[int]], hidden: int, concurrency: int, per_request: int) -> Row:
    """(c): `concurrency` clients POST /v1/embeddings, `per_request` chunks per call (base64, as
    the openai SDK asks), until every chunk is embedded."""
    return asyncio.run(_concurrent(url, chunks, hidden, concurrency, per_request))


def metered(meter: CpuMeter, run: Callable[[], Row]) -> Row:
    """run()'s row with the CPU seconds each metered process spent meanwhile."""
    meter.start()
    row = run()
    row.cpu_s = meter.stop()
    return row


def cpu_table(rows: list[Row]) -> str:
    """CPU microseconds per input, by process: on a GPU the engine's process spends its own on
    the step; the rest is the fleet's host cost, each process's ceiling 1e6 / its figure."""
    lines = ["| path | CPU us per input, by process |", "| --- | --- |"]
    for row in rows:
        if row.cpu_s and row.num_inputs:
            lines.append(f"| {row.path} | " + ", ".join(f"{name} {1e6 * s / row.num_inputs:,.0f}"
                                                        for name, s in row.cpu_s.items()) + " |")
    return "\n".join(lines)


def table(rows: list[Row], baseline: Row | None) -> str:
    lines = ["| path | inputs | tokens | s | inputs/s | tokens/s | vs engine | errors |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        ratio = (f"{row.inputs_per_s / baseline.inputs_per_s:.2f}"
                 if baseline is not None and baseline.inputs_per_s and row.seconds else "")
        tokens_per_s = row.num_tokens / row.seconds if row.seconds else 0.0
        lines.append(f"| {row.path} | {row.num_inputs} | {row.num_tokens} | {row.seconds:.2f} | "
                     f"{row.inputs_per_s:.1f} | {tokens_per_s:.0f} | {ratio} | "
                     f"{len(row.errors)}{': ' + row.errors[0][:80] if row.errors else ''} |")
    return "\n".join(lines)
