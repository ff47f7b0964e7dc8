"""`tokenfleet bench`: a load generator against a running gateway (any OpenAI-compatible server).

It sends streamed chat (or text) completions, at most `--concurrency` at a time and, with
`--rate`, at that many new ones per second (Poisson arrivals, seeded): `--num-requests` of them,
or as many as arrive in `--duration` seconds. Prompts are synthetic: an optional system prompt of
about `--prefix-tokens` tokens that every request shares (the prefix cache's case), then a user
turn of `--prompt-words` words; each asks for `--max-tokens` output tokens (`ignore_eos`). Both
lengths take a fixed number, a uniform range `A-B`, or `A-B:lognormal:MEAN` (lognormal of that
mean, sigma 0.8, clipped to A..B).

With `--client-processes N` the requests are dealt over N client processes, so that one
process parsing every chunk of every stream does not add its own queueing to the latencies.

From the chunks' arrival times it reports, per request: time to first token (TTFT), inter-token
latency (ITL: the gap before each later content chunk; the gateway sends one chunk per scheduler
step, which is one token in a plain decode, and the OpenAI chunk does not say how many tokens it
holds), time per output token after the first (TPOT), end-to-end latency; and for the run:
requests and output tokens per second, every failure with its reason and, given
`--slo-ttft-ms` and/or `--slo-itl-ms`, the goodput: the requests (and their tokens) per second
whose TTFT and whose mean inter-token gap (TPOT) met them.

With `--json-share F` a fraction F of the chats (picked by their own seeded draw: the prompts
and arrivals stay those of the plain run) ask for a `json_schema` answer (`BENCH_SCHEMA`: one
string of at least 4,096 characters, so a chat's answer runs to its max_tokens, as a plain one).
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import multiprocessing
import random
import time
from collections.abc import AsyncIterator, Callable
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
    req_id: str | None = None  # the fleet's id (its tokenfleet-request-id header)
    started_wall: float = 0.0  # time.time() of started and first_token, to set beside the
    first_token_wall: float | None = None  # record's timestamps (scripts/bench_serve_gpu.py)

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first."""
        if self.first_token is None or self.finished is None or self.output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.output_tokens - 1)


@dataclass(frozen=True)
class LengthSpec:
    """A length drawn per request: fixed (low == high), uniform on low..high, or lognormal."""

    low: int
    high: int
    lognormal_mean: float | None = None

    @classmethod
    def parse(cls, text: str, flag: str) -> LengthSpec:
        """"N", "A-B" or "A-B:lognormal:MEAN"; a ValueError names the flag."""
        bounds, _, dist = str(text).partition(":")
        try:
            low, _, high = bounds.partition("-")
            spec = cls(int(low), int(high or low))
            if dist:
                kind, _, mean = dist.partition(":")
                if kind != "lognormal":
                    raise ValueError(kind)
                spec = cls(spec.low, spec.high, float(mean))
        except ValueError:
            raise ValueError(f"--{flag} takes N, A-B or A-B:lognormal:MEAN, got {text!r}") from None
        if not 1 <= spec.low <= spec.high or (spec.lognormal_mean is not None and spec.lognormal_mean <= 0):
            raise ValueError(f"--{flag} needs 1 <= A <= B (and a positive mean), got {text!r}")
        return spec

    def draw(self, rng: random.Random) -> int:
        if self.lognormal_mean is not None:
            sigma = 0.8  # a lognormal of mean m has mu = ln m - sigma^2 / 2
            value = round(rng.lognormvariate(math.log(self.lognormal_mean) - sigma**2 / 2, sigma))
            return min(self.high, max(self.low, value))
        return rng.randint(self.low, self.high)


@dataclass
class Planned:
    arrival: float  # seconds after the start
    path: str
    body: dict


def prompt_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


# The schema of --json-share's chats: an answer that cannot end before its max_tokens.
BENCH_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "minLength": 4096}},
                "required": ["answer"], "additionalProperties": False}
BENCH_RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": BENCH_SCHEMA}}


def json_chats(num: int, share: float, seed: int) -> list[bool]:
    """Which of `num` planned chats ask for BENCH_SCHEMA: each with probability `share`, from a
    draw of its own (the same chats for the same seed and share)."""
    rng = random.Random(f"json-{seed}")
    return [rng.random() < share for _ in range(num)]


def plan_requests(args, model: str) -> list[Planned]:
    """Every request of a run, with its arrival time: the same for the same flags and seed (a
    benchmark feeds the in-process engine the same plan)."""
    rng = random.Random(args.seed)
    prompt_words = LengthSpec.parse(args.prompt_words, "prompt-words")
    max_tokens = LengthSpec.parse(args.max_tokens, "max-tokens")
    # Common words are about a token each with their space: N words are about N tokens.
    prefix = prompt_text(random.Random(f"prefix-{args.seed}"), args.prefix_tokens) \
        if args.prefix_tokens else ""

    def more(num_planned: int, t: float) -> bool:
        return t < args.duration if args.duration else num_planned < args.num_requests

    arrivals: list[float] = []
    t = 0.0
    while more(len(arrivals), t):
        arrivals.append(t)
        t += rng.expovariate(args.rate) if args.rate > 0 else 0.0
    planned = []
    for arrival in arrivals:
        text = prompt_text(rng, prompt_words.draw(rng))
        body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": max_tokens.draw(rng), "temperature": args.temperature, "ignore_eos": True}
        if args.completions:
            planned.append(Planned(arrival, "/v1/completions",
                                   {**body, "prompt": f"{prefix}\n\n{text}" if prefix else text}))
            continue
        messages = [{"role": "system", "content": prefix}] if prefix else []
        messages.append({"role": "user", "content": text})
        planned.append(Planned(arrival, "/v1/chat/completions", {**body, "messages": messages}))
    share = getattr(args, "json_share", 0.0)
    if share and not args.completions:
        for plan, is_json in zip(planned, json_chats(len(planned), share, args.seed), strict=True):
            if is_json:
                plan.body["response_format"] = BENCH_RESPONSE_FORMAT
    return planned



async def sse_chunks(response: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The JSON chunks of a streamed response's `data:` lines, up to `data: [DONE]`."""
    async for raw in response.content:
        line = raw.decode(errors="replace").strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])

async def one_request(session: aiohttp.ClientSession, url: str, body: dict, result: Result) -> None:
    result.started = time.perf_counter()
    result.started_wall = time.time()
    last = None
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return
            result.req_id = response.headers.get("tokenfleet-request-id")
            async for chunk in sse_chunks(response):
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
                    result.first_token_wall = time.time()
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


async def run(args, on_start: Callable[[], object] | None = None) -> tuple[list[Result], float, str]:
    """Every planned request, from this process or from `--client-processes` of them. on_start
    is called as the first request's time is fixed, after the client processes are ready (a
    profiler started then sees the load, not their imports)."""
    on_start = on_start or (lambda: None)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(headers=headers) as session:
        model = args.model or await discover_model(session, args.url)
    planned = plan_requests(args, model)
    num_processes = max(1, min(getattr(args, "client_processes", 1), len(planned)))
    if num_processes == 1:
        start = time.perf_counter()
        on_start()
        results = await _drive(args, planned, list(range(len(planned))), start)
        return results, time.perf_counter() - start, model
    results, wall = await asyncio.to_thread(_drive_in_processes, args, planned, num_processes, on_start)
    return results, wall, model


async def _drive(args, planned: list[Planned], indices: list[int], start: float) -> list[Result]:
    """Send planned[i] for each i at its arrival time after `start` (a perf_counter time)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, connect=30, sock_read=args.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        gate = asyncio.Semaphore(args.concurrency)
        results = [Result(i) for i in indices]

        async def go(result: Result) -> None:
            await asyncio.sleep(max(0.0, start + planned[result.index].arrival - time.perf_counter()))
            async with gate:
                await one_request(session, args.url + planned[result.index].path, planned[result.index].body,
                                  result)

        await asyncio.gather(*(go(result) for result in results))
        return results


def _drive_in_processes(args, planned: list[Planned], num_processes: int,
                        on_start: Callable[[], object]) -> tuple[list[Result], float]:
    """The plan dealt round-robin over client processes, so that the load generator's own
    parsing (one process reads every chunk of every stream) does not add to the latency it
    measures. perf_counter is the system's monotonic clock, the same in every process: each
    client, once ready, is told the one start time."""
    context = multiprocessing.get_context("spawn")
    connections, processes = [], []
    for k in range(num_processes):
        ours, theirs = context.Pipe()
        indices = list(range(k, len(planned), num_processes))
        share = copy.copy(args)
        share.concurrency = -(-args.concurrency // num_processes)  # (the cap is for them all)
        process = context.Process(target=_client_process, args=(share, planned, indices, theirs), daemon=True)
        process.start()
        theirs.close()
        connections.append(ours)
        processes.append(process)
    try:
        for conn, process in zip(connections, processes, strict=True):
            _receive(conn, process)  # "ready"
        start = time.perf_counter() + 0.1
        for conn in connections:
            conn.send(start)
        on_start()
        results = [r for conn, process in zip(connections, processes, strict=True)
                   for r in _receive(conn, process)]
    finally:
        for process in processes:
            process.join(timeout=5)
    return sorted(results, key=lambda r: r.index), time.perf_counter() - start


def _receive(conn, process):
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"client process {process.pid} died (exit code {process.exitcode})") from None


def _client_process(args, planned: list[Planned], indices: list[int], conn) -> None:
    conn.send("ready")
    start = conn.recv()
    conn.send(asyncio.run(_drive(args, planned, indices, start)))
    conn.close()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summarize(results: list[Result], wall_s: float, model: str, args) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.first_token - r.started for r in ok]
    e2e = [r.finished - r.started for r in ok]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    gaps = [g for r in ok for g in r.gaps]
    output_tokens = sum(r.output_tokens for r in ok)

    def spread(values: list[float]) -> dict:
        return {f"p{q}": round(percentile(values, q) * 1e3, 2) if values else None for q in (50, 90, 99)}

    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    summary = {
        "url": args.url, "model": model, "num_requests": len(results), "ok": len(ok),
        "failed": len(results) - len(ok), "errors": errors, "concurrency": args.concurrency,
        "rate": args.rate or None, "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s else None,
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / wall_s, 1) if wall_s else None,
        "ttft_ms": spread(ttft), "itl_ms": spread(gaps), "tpot_ms": spread(tpot), "e2e_ms": spread(e2e),
    }
    if args.slo_ttft_ms is not None or args.slo_itl_ms is not None:
        good = [r for r in ok if meets_slo(r, args.slo_ttft_ms, args.slo_itl_ms)]
        summary["goodput"] = {
            "slo_ttft_ms": args.slo_ttft_ms, "slo_itl_ms": args.slo_itl_ms, "requests": len(good),
            "requests_per_s": round(len(good) / wall_s, 3) if wall_s else None,
            "output_tokens_per_s": round(sum(r.output_tokens for r in good) / wall_s, 1) if wall_s else None,
        }
    return summary


def meets_slo(result: Result, slo_ttft_ms: float | None, slo_itl_ms: float | None) -> bool:
    """TTFT within its bound and the mean gap between later tokens (TPOT) within the ITL bound."""
    if slo_ttft_ms is not None and (result.first_token - result.started) * 1e3 > slo_ttft_ms:
        return False
    return slo_itl_ms is None or result.tpot is None or result.tpot * 1e3 <= slo_itl_ms


def print_table(summary: dict) -> None:
    print(f"{summary['ok']}/{summary['num_requests']} requests to {summary['url']} ({summary['model']}), "
          f"concurrency {summary['concurrency']}, rate {summary['rate'] or 'unbounded'}")
    print(f"wall {summary['wall_s']:.1f} s, {summary['requests_per_s']} requests/s, "
          f"{summary['output_tokens']} output tokens, {summary['output_tokens_per_s']} output tok/s")
    print("| ms | p50 | p90 | p99 |")
    print("| --- | ---: | ---: | ---: |")
    for name in ("ttft", "itl", "tpot", "e2e"):
        row = summary[f"{name}_ms"]
        print(f"| {name.upper()} | {row['p50']} | {row['p90']} | {row['p99']} |")
    if "goodput" in summary:
        good = summary["goodput"]
        print(f"goodput (TTFT <= {good['slo_ttft_ms']} ms, TPOT <= {good['slo_itl_ms']} ms): "
              f"{good['requests']} requests, {good['requests_per_s']} requests/s, "
              f"{good['output_tokens_per_s']} output tok/s")
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
