"""Tokens per second over a window, and the one-line throughput log a scheduler writes every
few seconds while it has work (as vLLM's engine does): silent when idle."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import structlog

from scheduler.engine_metrics import EngineMetrics


@dataclass
class Rates:
    prompt_tokens_per_s: float = 0.0
    generation_tokens_per_s: float = 0.0


class RateMeter:
    """Prompt and generation tok/s since the previous `take`."""

    def __init__(self, metrics: EngineMetrics, now: float | None = None) -> None:
        self.metrics = metrics
        self._since = time.monotonic() if now is None else now
        self._prompt = metrics.num_prompt_tokens
        self._generation = metrics.num_generation_tokens

    def take(self, now: float) -> tuple[Rates, int]:
        """(rates, tokens of either kind) since the previous call; starts the next window."""
        elapsed = max(now - self._since, 1e-9)
        prompt = self.metrics.num_prompt_tokens - self._prompt
        generation = self.metrics.num_generation_tokens - self._generation
        self._since, self._prompt, self._generation = now, self.metrics.num_prompt_tokens, \
            self.metrics.num_generation_tokens
        return Rates(prompt / elapsed, generation / elapsed), prompt + generation


class ThroughputLog:
    """Every `interval_s`, one `engine_throughput` line: prompt and generation tok/s, running,
    waiting, KV use; only for windows with tokens or requests in them (an idle scheduler is
    silent; the window in which work ended still gets its line). interval_s <= 0: never."""

    def __init__(self, metrics: EngineMetrics, interval_s: float = 5.0, logger=None) -> None:
        self.metrics = metrics
        self.interval_s = interval_s
        self.log = logger or stats_logger()
        self._meter = RateMeter(metrics)
        self._next = time.monotonic() + interval_s

    def maybe_log(self, now: float | None = None) -> bool:
        """Log if a window has ended and it had work; True when a line was written."""
        if self.interval_s <= 0:
            return False
        now = time.monotonic() if now is None else now
        if now < self._next:
            return False
        self._next = now + self.interval_s
        rates, num_tokens = self._meter.take(now)
        scheduler = self.metrics.scheduler
        running, waiting = scheduler.num_running_requests, scheduler.num_waiting_requests
        if not (num_tokens or running or waiting):
            return False
        self.log.info("engine_throughput",
                      prompt_tokens_per_s=round(rates.prompt_tokens_per_s, 1),
                      generation_tokens_per_s=round(rates.generation_tokens_per_s, 1),
                      num_running=running, num_waiting=waiting,
                      kv_cache_usage_pct=round(100 * scheduler.block_manager.usage, 1))
        return True


def stats_logger(**context: object):
    """A logger that writes info lines whatever the process's log level (WARNING by default):
    the throughput line has its own switch, `--log-stats-interval-s 0`, as vLLM's has."""
    wrapper = structlog.make_filtering_bound_logger(logging.INFO)
    return structlog.wrap_logger(None, wrapper_class=wrapper).bind(logger="tokenfleet.scheduler", **context)
