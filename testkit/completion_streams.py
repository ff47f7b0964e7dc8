"""Streaming /v1/completions clients, as the GPU benchmarks' load: prompts as token ids, greedy,
EOS ignored, every chunk with text timestamped as it arrives (aiohttp, in the calling process,
or dealt over several client processes). A stream that does not end with exactly its max_tokens
(finish_reason "length") is an error."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from dataclasses import dataclass, field

import aiohttp

from testkit.sse import DONE, data_lines


@dataclass
class Stream:
    """One client's view of its streamed completion (times are time.monotonic())."""

    start: float = 0.0
    req_id: str | None = None  # from the chunks' id ("cmpl-<req_id>"), to find its tf:res record
    chunk_times: list[float] = field(default_factory=list)  # arrivals of chunks with text
    end: float = 0.0
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None


async def run_stream(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int,
                     gate: asyncio.Semaphore) -> Stream:
    """One streamed completion of exactly max_tokens (EOS ignored); its error, if it ended otherwise."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    stream = Stream()
    async with gate:
        stream.start = time.monotonic()
        try:
            async with session.post(f"{url}/v1/completions", json=body) as response:
                if response.status != 200:
                    stream.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                    return stream
                async for now, data in data_lines(response.content):
                    read_event(stream, data, now)
        except Exception as exc:  # noqa: BLE001 - a failed stream is counted, not the end of the run
            stream.error = f"{type(exc).__name__}: {exc}"
    if stream.error is None and not (stream.end and stream.chunk_times):
        stream.error = "no text, or no data: [DONE]"
    elif stream.error is None and (stream.finish_reason, stream.completion_tokens) != ("length", max_tokens):
        stream.error = (f"finish_reason {stream.finish_reason!r}, {stream.completion_tokens} of "
                        f"{max_tokens} tokens")
    return stream


def read_event(stream: Stream, payload: str, now: float) -> None:
    """One event's data, arrived at `now`, into the stream."""
    if payload == DONE:
        stream.end = now
        return
    chunk = json.loads(payload)
    if stream.req_id is None:
        stream.req_id = chunk["id"].removeprefix("cmpl-")
    if chunk.get("usage"):
        stream.completion_tokens = chunk["usage"]["completion_tokens"]
    for choice in chunk["choices"]:
        if choice.get("text"):
            stream.chunk_times.append(now)
        stream.finish_reason = choice.get("finish_reason") or stream.finish_reason


async def run_streams(url: str, model: str, prompts: list[list[int]], max_tokens: list[int], concurrency: int,
                      timeout_s: float) -> tuple[list[Stream], float]:
    """Every prompt streamed, concurrency at a time; (the streams, time.monotonic() at the start)."""
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, connect=60, sock_read=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.monotonic()
        streams = await asyncio.gather(*(run_stream(session, url, model, p, m, gate)
                                         for p, m in zip(prompts, max_tokens, strict=True)))
    return streams, start


def run_streams_in_processes(url: str, model: str, prompts: list[list[int]], max_tokens: list[int],
                             concurrency: int, timeout_s: float,
                             processes: int, on_start=lambda: None) -> tuple[list[Stream], float, float]:
    """run_streams with the prompts dealt round-robin over `processes` client processes that start
    together, as independent clients would: one Python process sending a 500-request burst spends
    a few hundred ms of its own CPU before its last request leaves. Returns the streams in the
    prompts' order, the earliest start (time.monotonic() is one clock for every process) and the
    time.time() the processes were let go."""
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Barrier(processes + 1)  # every process has imported aiohttp and waits
    results = ctx.Queue()
    each = max(1, concurrency // processes)
    workers = [ctx.Process(target=_run_share, daemon=True,
                           args=(i, url, model, prompts[i::processes], max_tokens[i::processes], each,
                                 timeout_s, ready, results)) for i in range(processes)]
    for worker in workers:
        worker.start()
    ready.wait(120)
    start_wall = time.time()
    on_start()  # e.g. a profiler: from here on the load runs, not the processes' imports
    shares = dict(results.get(timeout=timeout_s + 120) for _ in workers)  # before join: the queue's pipe
    for worker in workers:
        worker.join(30)
    streams: list[Stream] = [Stream()] * len(prompts)
    for i, (share_streams, _) in shares.items():
        streams[i::processes] = share_streams
    return streams, min(start for _, start in shares.values()), start_wall


def _run_share(index: int, url: str, model: str, prompts: list[list[int]], max_tokens: list[int],
               concurrency: int, timeout_s: float, ready, results) -> None:
    ready.wait(120)
    results.put((index, asyncio.run(run_streams(url, model, prompts, max_tokens, concurrency, timeout_s))))
