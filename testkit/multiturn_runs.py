"""Multi-turn conversations through an in-process engine (scripts/bench_kv_offload_gpu.py): each
conversation shares a system prompt, arrives at a Poisson time, and sends its turns one after the
other, each a think time (exponential, mean `think_s`) after the previous reply ended, every turn's
prompt its whole history (the system prompt, each user message and each reply so far) plus a new
user message; and a microbenchmark of the host tier's copies. The think time is what lets other
conversations push a conversation's blocks out of the GPU between its turns, as users and agents
that read, type or run tools between turns do."""

from __future__ import annotations

import bisect
import random
import time
from dataclasses import dataclass, field

import torch

from scheduler.engine import LLMEngine
from shared.sampling import SamplingParams
from testkit.runs import percentile


@dataclass
class Conversation:
    arrival: float  # seconds after the start when its next turn is sent
    user_turns: list[list[int]]  # token ids of each user message
    history: list[int] = field(default_factory=list)
    turn: int = 0
    req_id: str | None = None
    sent_at: float = 0.0
    last_token_at: float | None = None


def make_conversations(num: int, num_turns: int, *, system_tokens: int, user_tokens: int, rate: float,
                       vocab_size: int, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab_size) for _ in range(system_tokens)]
    conversations, t = [], 0.0
    for _ in range(num):
        turns = [[rng.randrange(3, vocab_size) for _ in range(user_tokens)] for _ in range(num_turns)]
        conversations.append(Conversation(t, turns, history=list(system)))
        t += rng.expovariate(rate) if rate > 0 else 0.0
    return conversations


@dataclass
class MultiTurnRun:
    seconds: float = 0.0
    num_output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    gpu_hit_tokens: int = 0
    host_hit_tokens: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0

    def row(self) -> dict:
        return {"ttft_p50_ms": percentile(self.ttft_s, 50) * 1e3,
                "ttft_p99_ms": percentile(self.ttft_s, 99) * 1e3,
                "itl_p50_ms": percentile(self.itl_s, 50) * 1e3,
                "output_tok_s": self.num_output_tokens / self.seconds if self.seconds else 0.0,
                "gpu_hit_tokens": self.gpu_hit_tokens, "host_hit_tokens": self.host_hit_tokens,
                "load_gb_s": self.loaded_bytes / 1e9 / self.load_seconds if self.load_seconds else None}


def _counters(engine: LLMEngine) -> tuple[int, int, int, float]:
    tier = engine.scheduler.host_tier
    counters = tier.counters if tier is not None else None
    return (engine.scheduler.block_manager.prefix_cache_hits, counters.num_hit_tokens if counters else 0,
            counters.num_loaded_bytes if counters else 0, counters.load_seconds if counters else 0.0)


def run_conversations(engine: LLMEngine, conversations: list[Conversation], max_tokens: int,
                      think_s: float = 0.0, seed: int = 0) -> MultiTurnRun:
    """Every conversation to its end; each turn is sent a think time after the previous reply."""
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rng = random.Random(seed)
    run = MultiTurnRun()
    before = _counters(engine)
    waiting = sorted(conversations, key=lambda c: c.arrival)
    by_req: dict[str, Conversation] = {}
    start = time.perf_counter()

    def send(conversation: Conversation) -> None:
        conversation.history += conversation.user_turns[conversation.turn]
        conversation.req_id = engine.add_request(list(conversation.history), sampling)
        conversation.sent_at, conversation.last_token_at = time.perf_counter(), None
        by_req[conversation.req_id] = conversation

    while waiting or by_req:
        now = time.perf_counter() - start
        while waiting and waiting[0].arrival <= now:
            send(waiting.pop(0))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.01, waiting[0].arrival - now)) if waiting else 0.0)
            continue
        for out in engine.step():
            conversation = by_req[out.req_id]
            stamp = time.perf_counter()
            if out.new_token_ids:
                if conversation.last_token_at is None:
                    run.ttft_s.append(stamp - conversation.sent_at)
                else:
                    run.itl_s.append(stamp - conversation.last_token_at)
                conversation.last_token_at = stamp
                conversation.history += out.new_token_ids
                run.num_output_tokens += len(out.new_token_ids)
            if out.finished:
                del by_req[out.req_id]
                conversation.turn += 1
                if conversation.turn < len(conversation.user_turns):
                    think = rng.expovariate(1.0 / think_s) if think_s > 0 else 0.0
                    conversation.arrival = stamp - start + think
                    bisect.insort(waiting, conversation, key=lambda c: c.arrival)
    run.seconds = time.perf_counter() - start
    after = _counters(engine)
    run.gpu_hit_tokens, run.host_hit_tokens, run.loaded_bytes = (a - b for a, b in zip(after[:3], before[:3],
                                                                                       strict=True))
    run.load_seconds = after[3] - before[3]
    return run


def load_rates(engine: LLMEngine, sizes: tuple[int, ...] = (1, 8, 64)) -> dict[str, float]:
    """The host tier's copy rates (GB/s, best of 3) of its runner's pool, after a run (it writes
    GPU blocks: their cached prefixes are forgotten first). Loads and stores of n blocks, with
    adjacent host slots (one copy a run) and scattered ones (one copy a block)."""
    runner = engine.executor.runner
    pool = runner.host_kv
    engine.scheduler.block_manager.reset_prefix_cache()
    rates = {}
    for n in sizes:
        n = min(n, pool.num_blocks // 2, runner.num_kv_blocks)
        for layout, slots in (("adjacent", list(range(n))), ("scattered", list(range(0, 2 * n, 2)))):
            for kind in ("load", "store"):
                pairs = list(zip(slots, range(n), strict=True))
                if kind == "store":
                    pairs = [(block, slot) for slot, block in pairs]
                best = float("inf")
                for _ in range(3):
                    if runner.device.type == "cuda":
                        torch.cuda.synchronize(runner.device)
                    started = time.perf_counter()
                    copies = pool.copy(pairs if kind == "store" else [], pairs if kind == "load" else [])
                    copies.wait()
                    best = min(best, time.perf_counter() - started)
                rates[f"{kind} {n} blocks, {layout} slots"] = n * pool.block_bytes / 1e9 / best
    return rates
