"""`tokenfleet bench --multi-turn`: conversations that come back, as vLLM's benchmarks/multi_turn and
SGLang's bench_multiturn.py drive them.

`--conversations N` conversations arrive at `--rate` per second (Poisson, seeded; 0: all at once),
at most `--concurrency` of them talking at a time. Each shares one system prompt of about
`--prefix-tokens` tokens and runs `--turns K` turns in order: a user message of `--prompt-words`
words, the streamed reply of `--max-tokens` tokens (EOS ignored) appended to the history with it,
so every turn resends the whole conversation. Between a reply and the next user message the user
thinks for `--think-seconds` on average (exponential, seeded; 0: no pause), as
testkit/multiturn_runs.py does: the pause is what lets other conversations push a conversation's
KV blocks out of the GPU between its turns, as people and agents that read, type or run tools do.

It reports what `tokenfleet bench` does (TTFT, ITL, TPOT, end-to-end, output tok/s) over every
turn, TTFT by turn (the first turn has only the system prompt to find; later ones the history),
the prompt tokens the responses' usage says were cached (`prompt_tokens_details.cached_tokens`,
every tier), and from the fleet's schedulers (`/fleet.json`, read before and after: their
heartbeats, a heartbeat late) the hits per tier and the host tier's load rate.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import aiohttp

from tokenfleet.bench import (
    LengthSpec,
    Result,
    discover_model,
    percentile,
    prompt_text,
    sse_chunks,
    summarize,
)

# Read from each scheduler in /fleet.json: the prefix cache's and the host tier's totals.
FLEET_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "host_kv_hit_tokens", "host_kv_loaded_bytes",
                  "host_kv_load_seconds")
HEARTBEAT_WAIT_S = 2.5  # for the schedulers' next heartbeat after the last turn


def add_multi_turn_flags(bench, flag) -> None:
    """`tokenfleet bench`'s multi-turn flags (`flag`: the CLI's flag helper)."""
    flag(bench, "multi-turn", action="store_true",
         help="conversations that come back: --conversations of --turns turns, each resending its "
              "history, arriving at --rate per second (tokenfleet/bench_multiturn.py)")
    flag(bench, "conversations", type=int, default=16, help="with --multi-turn: how many")
    flag(bench, "turns", type=int, default=4, help="with --multi-turn: turns of each conversation")
    flag(bench, "think-seconds", type=float, default=0.0,
         help="with --multi-turn: mean pause between a reply and the next user message (exponential, "
              "seeded; 0: none)")


def check_multi_turn_args(args) -> None:
    from shared.errors import InvalidRequestError

    if args.conversations < 1 or args.turns < 1:
        raise InvalidRequestError("--multi-turn needs --conversations and --turns >= 1", param="multi-turn")
    if not args.think_seconds >= 0:  # (NaN too)
        raise InvalidRequestError(f"--think-seconds must be >= 0, got {args.think_seconds}",
                                  param="think-seconds")
    if args.completions or args.duration or args.json_share:
        raise InvalidRequestError("--multi-turn runs chats: not with --completions, --duration or "
                                  "--json-share", param="multi-turn")


@dataclass
class TurnResult(Result):
    conversation: int = 0
    turn: int = 0
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Conversation:
    arrival: float  # seconds after the start
    user_messages: list[str]
    max_tokens: list[int]
    think_s: list[float]  # the pause before each turn (0 before the first)


def plan_conversations(args) -> tuple[str, list[Conversation]]:
    """The system prompt and every conversation: the same for the same flags and seed."""
    rng = random.Random(args.seed)
    words = LengthSpec.parse(args.prompt_words, "prompt-words")
    max_tokens = LengthSpec.parse(args.max_tokens, "max-tokens")
    system = ""
    if args.prefix_tokens:
        system = prompt_text(random.Random(f"prefix-{args.seed}"), args.prefix_tokens)
    # Its own draw, so that the prompts and arrivals are the same with any --think-seconds.
    think_rng = random.Random(f"think-{args.seed}")
    conversations, t = [], 0.0
    for _ in range(args.conversations):
        think = [think_rng.expovariate(1.0 / args.think_seconds) if turn and args.think_seconds > 0 else 0.0
                 for turn in range(args.turns)]
        conversations.append(Conversation(t, [prompt_text(rng, words.draw(rng)) for _ in range(args.turns)],
                                          [max_tokens.draw(rng) for _ in range(args.turns)], think))
        t += rng.expovariate(args.rate) if args.rate > 0 else 0.0
    return system, conversations


async def stream_turn(session: aiohttp.ClientSession, url: str, body: dict, result: TurnResult) -> None:
    """One streamed chat turn: its timings, reply text and usage into `result`."""
    result.started = time.perf_counter()
    last = None
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return
            async for chunk in sse_chunks(response):
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message')}"
                    return
                usage = chunk.get("usage")
                if usage:
                    result.output_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
                choices = chunk.get("choices")
                text = (choices[0].get("delta") or {}).get("content") if choices else None
                if not text:
                    continue
                now = time.perf_counter()
                if result.first_token is None:
                    result.first_token = now
                elif last is not None:
                    result.gaps.append(now - last)
                last = now
                result.text += text
        result.finished = time.perf_counter()
        result.ok = result.first_token is not None
        if not result.ok:
            result.error = "the stream ended without a token"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"


async def fleet_counters(session: aiohttp.ClientSession, base_url: str) -> dict[str, float] | None:
    """The schedulers' totals of FLEET_COUNTERS, summed; None when /fleet.json is not there."""
    try:
        async with session.get(f"{base_url}/fleet.json") as response:
            if response.status != 200:
                return None
            schedulers = (await response.json()).get("schedulers", [])
    except (aiohttp.ClientError, json.JSONDecodeError):
        return None
    return {name: sum(float(s.get(name) or 0) for s in schedulers) for name in FLEET_COUNTERS}


async def run_multi_turn(args) -> tuple[list[TurnResult], float, str, dict | None]:
    """Every conversation to its end; (turns, wall seconds, model, fleet counters' increase)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, connect=30, sock_read=args.timeout_s)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        model = args.model or await discover_model(session, args.url)
        system, conversations = plan_conversations(args)
        before = await fleet_counters(session, args.url)
        gate = asyncio.Semaphore(args.concurrency)
        results: list[TurnResult] = []
        start = time.perf_counter()

        async def talk(index: int, conversation: Conversation) -> None:
            await asyncio.sleep(max(0.0, start + conversation.arrival - time.perf_counter()))
            messages = [{"role": "system", "content": system}] if system else []
            async with gate:
                plan = zip(conversation.user_messages, conversation.max_tokens, conversation.think_s,
                           strict=True)
                for turn, (message, max_tokens, think_s) in enumerate(plan):
                    if think_s:
                        await asyncio.sleep(think_s)
                    messages.append({"role": "user", "content": message})
                    body = {"model": model, "messages": messages, "stream": True, "max_tokens": max_tokens,
                            "stream_options": {"include_usage": True}, "temperature": args.temperature,
                            "ignore_eos": True}
                    result = TurnResult(len(results), conversation=index, turn=turn)
                    results.append(result)
                    await stream_turn(session, args.url + "/v1/chat/completions", body, result)
                    if not result.ok:
                        return  # the rest of this conversation would resend a broken history
                    messages.append({"role": "assistant", "content": result.text})

        await asyncio.gather(*(talk(i, c) for i, c in enumerate(conversations)))
        wall = time.perf_counter() - start
        after = None
        if before is not None:
            await asyncio.sleep(HEARTBEAT_WAIT_S)
            after = await fleet_counters(session, args.url)
    delta = {name: after[name] - before[name] for name in FLEET_COUNTERS} if after and before else None
    return results, wall, model, delta


def summarize_multi_turn(results: list[TurnResult], wall_s: float, model: str, args,
                         fleet: dict | None) -> dict:
    summary = summarize(results, wall_s, model, args)
    ok = [r for r in results if r.ok]
    ttfts: dict[int, list[float]] = {}
    for r in ok:
        ttfts.setdefault(r.turn, []).append(r.first_token - r.started)
    summary.update({
        "conversations": args.conversations, "turns": args.turns, "think_seconds": args.think_seconds,
        "ttft_ms_by_turn": {turn: round(percentile(values, 50) * 1e3, 2)
                            for turn, values in sorted(ttfts.items())},
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
    })
    if fleet is not None:
        host, loaded = fleet["host_kv_hit_tokens"], fleet["host_kv_loaded_bytes"]
        seconds = fleet["host_kv_load_seconds"]
        summary["fleet"] = {
            "gpu_hit_tokens": int(fleet["prefix_cache_hits"]), "host_hit_tokens": int(host),
            "queried_tokens": int(fleet["prefix_cache_queries"]),
            "host_loaded_gb": round(loaded / 1e9, 3),
            "host_load_gb_per_s": round(loaded / 1e9 / seconds, 2) if seconds else None,
        }
    return summary


def print_multi_turn(summary: dict) -> None:
    from tokenfleet.bench import print_table

    think = f", {summary['think_seconds']:g} s think time (mean)" if summary["think_seconds"] else ""
    print(f"{summary['conversations']} conversations of {summary['turns']} turns{think}")
    print_table(summary)
    print("TTFT p50 by turn (ms): " + ", ".join(f"{t}: {ms}" for t, ms in summary["ttft_ms_by_turn"].items()))
    print(f"prompt tokens {summary['prompt_tokens']}, cached (usage, every tier) {summary['cached_tokens']}")
    fleet = summary.get("fleet")
    if fleet:
        print(f"hits: GPU {fleet['gpu_hit_tokens']} tokens, host tier {fleet['host_hit_tokens']} tokens "
              f"(of {fleet['queried_tokens']} looked up); host loads {fleet['host_loaded_gb']} GB at "
              f"{fleet['host_load_gb_per_s']} GB/s")


def run_multi_turn_command(args) -> int:
    """`tokenfleet bench --multi-turn`: exit 0 when every turn streamed to its end, 1 otherwise."""
    results, wall_s, model, fleet = asyncio.run(run_multi_turn(args))
    summary = summarize_multi_turn(results, wall_s, model, args, fleet)
    if args.json:
        print(json.dumps(summary))
    else:
        print_multi_turn(summary)
    return 0 if summary["failed"] == 0 else 1
