"""`tokenfleet bench`: a load generator against a running gateway (any OpenAI-compatible server).

It sends `--num-requests` streamed chat (or text) completions, at most `--concurrency` at a
time and, with `--rate`, at most that many new ones per second (Poisson arrivals, seeded),
with synthetic prompts of `--prompt-words` words and exactly `--max-tokens` output tokens
(`ignore_eos`). From the chunks' arrival times it reports, per request: time to first token
(TTFT), inter-token latency (ITL: the gap before each later content chunk; the gateway
sends one chunk per scheduler step, which is one token in a plain decode, and the OpenAI
chunk does not say how many tokens it holds), end-to-end latency; and for the run: requests
and output tokens per second, and every failure with its reason.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import aiohttp

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
         "point government company number group problem fact river mountain city garden market music "
         "story letter table window ocean forest engine signal").split()


@dataclass
class Result:
    index: int
    ok: bool = False
    error: str | None = None
    started: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive tokens


def prompt_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def request_body(args, rng: random.Random, model: str) -> tuple[str, dict]:
    text = prompt_text(rng, args.prompt_words)
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": args.max_tokens, "temperature": args.temperature, "ignore_eos": True}
    if args.completions:
        return "/v1/completions", {**body, "prompt": text}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}


async def one_request(session: aiohttp.ClientSession, url: str, body: dict, result: Result) -> None:
    result.started = time.perf_counter()
    last = None
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return
            async for raw in response.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message')}"
                    return
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                choice = chunk["choices"][0]
                text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                if not text:
                    continue
                now = time.perf_counter()
                if result.first_token is None:
                    result.first_token = now
                elif last is not None:
                    result.gaps.append(now - last)
                last = now
        result.finished = time.perf_counter()
        result.ok = result.first_token is not None
        if not result.ok:
            result.error = "the stream ended without a token"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"


async def discover_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as response:
        if response.status != 200:
            raise RuntimeError(f"GET /v1/models answered {response.status}: {(await response.text())[:200]}")
        models = (await response.json())["data"]
    if not models:
        raise RuntimeError("the server serves no model yet (no live scheduler?)")
    return models[0]["id"]


async def run(args) -> tuple[list[Result], float, str]:
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, connect=30, sock_read=args.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        model = args.model or await discover_model(session, args.url)
        bodies = [request_body(args, rng, model) for _ in range(args.num_requests)]
        arrivals = [0.0] * args.num_requests
        if args.rate > 0:
            t = 0.0
            for i in range(args.num_requests):
                arrivals[i] = t
                t += rng.expovariate(args.rate)
        gate = asyncio.Semaphore(args.concurrency)
        results = [Result(i) for i in range(args.num_requests)]
        start = time.perf_counter()

        async def go(i: int) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            async with gate:
                path, body = bodies[i]
                await one_request(session, args.url + path, body, results[i])

        await asyncio.gather(*(go(i) for i in range(args.num_requests)))
        return results, time.perf_counter() - start, model


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summarize(results: list[Result], wall_s: float, model: str, args) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.first_token - r.started for r in ok]
    e2e = [r.finished - r.started for r in ok]
    gaps = [g for r in ok for g in r.gaps]
    output_tokens = sum(r.output_tokens for r in ok)

    def spread(values: list[float]) -> dict:
        return {f"p{q}": round(percentile(values, q) * 1e3, 2) if values else None for q in (50, 90, 99)}

    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    return {
        "url": args.url, "model": model, "num_requests": len(results), "ok": len(ok),
        "failed": len(results) - len(ok), "errors": errors, "concurrency": args.concurrency,
        "rate": args.rate or None, "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s else None,
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / wall_s, 1) if wall_s else None,
        "ttft_ms": spread(ttft), "itl_ms": spread(gaps), "e2e_ms": spread(e2e),
    }


def print_table(summary: dict) -> None:
    print(f"{summary['ok']}/{summary['num_requests']} requests to {summary['url']} ({summary['model']}), "
          f"concurrency {summary['concurrency']}, rate {summary['rate'] or 'unbounded'}")
    print(f"wall {summary['wall_s']:.1f} s, {summary['requests_per_s']} requests/s, "
          f"{summary['output_tokens']} output tokens, {summary['output_tokens_per_s']} output tok/s")
    print("| ms | p50 | p90 | p99 |")
    print("| --- | ---: | ---: | ---: |")
    for name in ("ttft", "itl", "e2e"):
        row = summary[f"{name}_ms"]
        print(f"| {name.upper()} | {row['p50']} | {row['p90']} | {row['p99']} |")
    for error, count in summary["errors"].items():
        print(f"failed x{count}: {error}")


def run_bench_command(args) -> int:
    """`tokenfleet bench`: exit 0 when every request streamed to its end, 1 otherwise."""
    results, wall_s, model = asyncio.run(run(args))
    summary = summarize(results, wall_s, model, args)
    if args.json:
        print(json.dumps(summary))
    else:
        print_table(summary)
    return 0 if summary["failed"] == 0 else 1
