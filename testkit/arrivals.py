"""The in-process engine under Poisson arrivals of chats: each request added when its time comes
(the loop checks between steps), TTFT from its scheduled arrival, ITL between the steps that gave
it tokens; and a meter of mixed steps' forward time and the sampler's wait for the GPU."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from testkit.engine_runs import record_step
from testkit.runs import percentile
from testkit.workloads import greedy, lognormal_length

if TYPE_CHECKING:
    from scheduler.engine import LLMEngine


@dataclass
class Chats:
    arrivals: list[float]  # seconds after the start
    prompts: list[list[int]]
    max_tokens: list[int]


def chat_arrivals(rate: float, seconds: float, prefix: list[int], vocab: int, seed: int) -> Chats:
    rng = random.Random(seed)
    chats = Chats([], [], [])
    t = rng.expovariate(rate)
    while t < seconds:
        user = [rng.randrange(3, vocab) for _ in range(round(rng.randint(40, 300) * 1.3))]
        chats.arrivals.append(t)
        chats.prompts.append(prefix + user)
        chats.max_tokens.append(lognormal_length(rng, 150, 0.8, 16, 512))
        t += rng.expovariate(rate)
    return chats


@dataclass
class StepMeter:
    """Times the runner's forward of mixed steps and the wait for the GPU (the host reading a
    step's sampled ids: `ModelRunner.finish`; under async scheduling, after the next step's launch)."""

    mixed_forward_s: list[float] = field(default_factory=list)
    graph_steps: int = 0
    gpu_wait_s: float = 0.0

    def attach(self, engine: LLMEngine) -> None:
        runner = engine.executor.runner
        forward, finish = runner.forward, runner.finish
        graphs = runner.mixed_graphs

        def timed_forward(batch, use_graphs=True):
            start = time.perf_counter()
            try:
                return forward(batch, use_graphs)
            finally:
                if any(len(w.token_ids) > 1 for w in batch.works):
                    self.mixed_forward_s.append(time.perf_counter() - start)
                    if graphs is not None and graphs.can_run(batch.works):
                        self.graph_steps += 1

        def timed_finish(*args, **kw):
            start = time.perf_counter()
            try:
                return finish(*args, **kw)
            finally:
                self.gpu_wait_s += time.perf_counter() - start

        runner.forward, runner.finish = timed_forward, timed_finish

    def detach(self, engine: LLMEngine) -> None:
        runner = engine.executor.runner
        del runner.forward, runner.finish


@dataclass
class ServingRow:
    """One run of the engine under arrivals (or a burst): throughput, latencies, mixed steps."""

    label: str
    tok_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p99: float
    mixed_ms: float
    mixed_steps: int
    graph_steps: int
    gpu_wait: float


def run_chats(engine: LLMEngine, chats: Chats, label: str) -> ServingRow:
    meter = StepMeter()
    meter.attach(engine)
    arrival: dict[str, float] = {}
    token_times: dict[str, list[float]] = {}
    num_output, i = 0, 0
    start = time.perf_counter()
    while i < len(chats.arrivals) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while i < len(chats.arrivals) and start + chats.arrivals[i] <= now:
            req_id = engine.add_request(chats.prompts[i], greedy(chats.max_tokens[i]))
            arrival[req_id] = start + chats.arrivals[i]
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.001, start + chats.arrivals[i] - now)))
            continue
        _, made = record_step(engine, token_times)
        num_output += made
    wall = max(t[-1] for t in token_times.values()) - start
    meter.detach(engine)
    ttft = [times[0] - arrival[r] for r, times in token_times.items()]
    itl = [b - a for times in token_times.values() for a, b in zip(times, times[1:], strict=False)]
    mixed = meter.mixed_forward_s
    return ServingRow(label, num_output / wall, percentile(ttft, 50), percentile(ttft, 99),
                      percentile(itl, 99), 1e3 * sum(mixed) / max(1, len(mixed)), len(mixed),
                      meter.graph_steps, meter.gpu_wait_s / wall)


