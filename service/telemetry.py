"""What a scheduler tells about itself: engine metrics, the throughput log, and the extra
heartbeat fields; one object the service holds, so that the service loop changes in three
places only (build it, tick it, add it to the heartbeat).

The metrics travel through Redis: at each heartbeat the scheduler writes its Prometheus text
to `tf:metrics:{scheduler_id}` with the heartbeat's TTL, and every gateway's /metrics serves
the texts of all live schedulers (gateway/fleet/engine_metrics.py). One scrape target for the whole
fleet, however many machines the schedulers run on, with no port to open or discover per
scheduler; a scheduler that dies drops out of the scrape when its key expires.
"""

from __future__ import annotations

import json
import os
import socket
import time

from scheduler.engine import LLMEngine
from scheduler.engine_metrics import EngineMetrics
from scheduler.throughput import RateMeter, ThroughputLog
from workers.device import resolve_device


class SchedulerTelemetry:
    def __init__(self, engine: LLMEngine, model_name: str, scheduler_id: str,
                 log_stats_interval_s: float = 5.0) -> None:
        self.engine = engine
        self.metrics = EngineMetrics(engine.scheduler, model_name, scheduler_id)
        engine.step_observer = self.metrics
        self.throughput_log = ThroughputLog(self.metrics, log_stats_interval_s)
        self._heartbeat_rates = RateMeter(self.metrics)
        self._started_at = time.time()
        config = engine.config
        # The limits the engine runs with, as resolved (max_model_len: the model's window when
        # no flag capped it), so that what a launcher asked for can be read back from Redis.
        self._engine_fields = {
            "tp": config.tp, "pp": config.pp, "device": str(resolve_device(config.device)),
            "max_num_batched_tokens": config.max_num_batched_tokens, "block_size": engine.executor.block_size,
            "max_model_len": engine.max_model_len,
            "max_lora_rank": config.max_lora_rank if config.enable_lora else 0,  # 0: no adapters
            "runner": config.runner,  # "pooling": it serves embeddings only (the gateway routes by it)
        }

    def tick(self) -> None:
        self.throughput_log.maybe_log()

    def heartbeat_fields(self) -> dict[str, object]:
        """Added to tf:sched:{id}: what `tokenfleet status` and the status page show beyond
        load and KV use (tok/s over the last heartbeat interval, totals, where it runs, the
        engine's limits)."""
        rates, _ = self._heartbeat_rates.take(time.monotonic())
        history = self.metrics.generation_history.recent(time.time())
        speculator = self.engine.scheduler.speculator
        # Speculative decoding's totals (scheduler/engine_metrics.py), for `tokenfleet status`.
        spec = {} if speculator is None else {
            "spec_num_drafts": speculator.num_drafts, "spec_num_draft_tokens": speculator.num_draft_tokens,
            "spec_num_accepted_tokens": speculator.num_accepted_tokens}
        host_tier = self.engine.scheduler.host_tier
        # The host KV tier (scheduler/host_tier.py): its blocks, use, hits and load traffic; 0 without.
        host_kv = {"num_host_kv_blocks": 0} if host_tier is None else {
            "num_host_kv_blocks": host_tier.num_blocks, "host_kv_usage": round(host_tier.usage, 4),
            "host_kv_hit_tokens": host_tier.counters.num_hit_tokens,
            "host_kv_loaded_bytes": host_tier.counters.num_loaded_bytes,
            "host_kv_load_seconds": round(host_tier.counters.load_seconds, 6)}
        return {
            **self._engine_fields, **spec, **host_kv,
            "host": socket.gethostname(), "pid": os.getpid(),
            "started_at": self._started_at,
            "prompt_tokens_per_s": round(rates.prompt_tokens_per_s, 2),
            "generation_tokens_per_s": round(rates.generation_tokens_per_s, 2),
            "num_prompt_tokens": self.metrics.num_prompt_tokens,
            "num_generation_tokens": self.metrics.num_generation_tokens,
            "num_finished": self.metrics.num_finished,
            "num_kv_blocks": self.engine.scheduler.block_manager.num_blocks,
            "generation_history": json.dumps(history, separators=(",", ":")),
            # The step cost model the step budget uses (scheduler/step_cost.py): [tokens, ms] points.
            "step_cost_ms": json.dumps([[round(p.num_tokens), round(p.ms, 2)]
                                        for p in self.engine.scheduler.step_cost.points()]),
            # LoRA adapters served, and those in a device slot now (a router's hint).
            "loras": json.dumps(self.engine.lora_names()),
            "loras_loaded": json.dumps(self.engine.scheduler.lora_slots.loaded_names()
                                       if self.engine.scheduler.lora_slots is not None else []),
        }

    def exposition(self) -> bytes:
        return self.metrics.exposition()
