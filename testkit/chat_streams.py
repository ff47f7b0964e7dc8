"""Many streaming /v1/chat/completions clients held open at once against one gateway (aiohttp,
in the calling process; greedy, EOS ignored), every data line timestamped on arrival, and a
strict check of each stream afterwards: well-formed chat.completion.chunk objects, one request
id, data: [DONE] last, finish_reason "length" and usage.completion_tokens == max_tokens."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from testkit.sse import DONE, data_lines


@dataclass
class Stream:
    """One client's stream: its raw data lines as they arrived, then (check_stream) its content chunks."""

    index: int
    lines: list[tuple[float, str]] = field(default_factory=list)  # (arrival, data)
    status: int | None = None
    error: str | None = None
    req_id: str | None = None
    chunks: list[tuple[float, str]] = field(default_factory=list)  # (arrival, content) with text


@dataclass
class Counter:
    """Streams open now, and the most open at once."""

    open: int = 0
    max_open: int = 0


def body(model: str, index: int, max_tokens: int) -> dict:
    return {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Stream {index}: tell me a long story."}]}


async def run_stream(session: aiohttp.ClientSession, url: str, model: str, stream: Stream, max_tokens: int,
                     delay_s: float, counter: Counter) -> None:
    await asyncio.sleep(delay_s)
    try:
        async with session.post(url, json=body(model, stream.index, max_tokens)) as response:
            stream.status = response.status
            if response.status != 200:
                stream.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            counter.open += 1
            counter.max_open = max(counter.max_open, counter.open)
            try:
                async for now, data in data_lines(response.content):
                    stream.lines.append((now, data))
            finally:
                counter.open -= 1
    except Exception as exc:  # noqa: BLE001 - every failure is counted, none stops the run
        stream.error = f"{type(exc).__name__}: {exc}"


async def run_clients(url: str, model: str, num_streams: int, max_tokens: int, ramp_s: float,
                      counter: Counter) -> tuple[list[Stream], float]:
    """num_streams streams, their starts spread over ramp_s; (the streams, the seconds they took)."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, connect=60, sock_read=120)
    streams = [Stream(i) for i in range(num_streams)]
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.monotonic()
        await asyncio.gather(*(run_stream(session, url, model, s, max_tokens, ramp_s * s.index / num_streams,
                                          counter) for s in streams))
        return streams, time.monotonic() - start


def check_stream(stream: Stream, max_tokens: int) -> None:
    """Parse the stream's data lines into stream.chunks; set stream.error on anything wrong."""
    if stream.error is not None:
        return
    done = False
    finish_reason = None
    completion_tokens = None
    for t, payload in stream.lines:
        if done:
            stream.error = "data after [DONE]"
            return
        if payload == DONE:
            done = True
            continue
        try:
            chunk = json.loads(payload)
            assert chunk["object"] == "chat.completion.chunk" and chunk["id"].startswith("chatcmpl-")
            req_id = chunk["id"].removeprefix("chatcmpl-")
            assert stream.req_id in (None, req_id)
            stream.req_id = req_id
            if chunk.get("usage") is not None:
                completion_tokens = chunk["usage"]["completion_tokens"]
            choices = chunk["choices"]
            if not choices:
                continue
            assert len(choices) == 1 and choices[0]["index"] == 0
            content = choices[0]["delta"].get("content")
            assert content is None or isinstance(content, str)
            if content:
                stream.chunks.append((t, content))
            finish_reason = choices[0]["finish_reason"] or finish_reason
        except (ValueError, KeyError, TypeError, AssertionError, AttributeError):
            stream.error = f"malformed chunk: {payload[:200]!r}"
            return
    if not done:
        stream.error = "no data: [DONE]"
    elif finish_reason != "length":
        stream.error = f"finish_reason {finish_reason!r}"
    elif completion_tokens != max_tokens:
        stream.error = f"usage.completion_tokens {completion_tokens} != {max_tokens}"
