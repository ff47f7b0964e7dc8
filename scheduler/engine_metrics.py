"""Prometheus metrics of one engine, named as vLLM names them but under the `tokenfleet:` prefix,
so that vLLM's Grafana dashboards and autoscaling recipes work with the prefix changed.

Every sample carries `model_name` (vLLM's label) and `scheduler` (which replica). The
engine calls `record_step` after each step (on its own thread); the gauges (running,
waiting, KV use) and the prefix-cache counters are read from the scheduler when the
registry is collected, which the service does on the same thread at each heartbeat, so
nothing here needs a lock of its own.

Counting rules (as vLLM v1 counts them):
- prompt tokens: a request's prompt length, once, when this engine samples its first token
  (a request preempted and recomputed is not counted again; a request taken over from a dead
  scheduler counts on the one that finishes it);
- generation tokens: every token sampled;
- request_success{finished_reason}: every request that ended, by why (stop, length, abort);
- iteration_tokens_total: tokens computed per step (prefill chunks plus decodes; drafts count);
- spec_decode_* (with speculative decoding only, as vLLM's): num_drafts (decodes that carried
  drafts), num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos{position} and
  num_emitted_tokens (accepted plus the target's own token, less what a stop cut). The acceptance
  rate is accepted / draft tokens; the mean accepted length is 1 + accepted / drafts. Ours
  beside them: num_lookups (decodes that looked for drafts, found or not: each ran without a
  step planned ahead), num_backoffs and num_resumes (requests the expected-gain rule turned off,
  and back on).
- host KV tier (with --kv-offloading-size only; scheduler/host_tier.py): external_prefix_cache_hits
  (vLLM's name for prompt tokens found outside the GPU cache: here loaded from the host), and
  kv_offload_{stored,loaded}_{blocks,bytes}, kv_offload_load_seconds (the load rate in bytes per
  second is rate(loaded_bytes) / rate(load_seconds)), kv_offload_usage_perc.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from scheduler.request import FinishReason
from scheduler.scheduler import RequestOutput, Scheduler, SchedulerOutput
from scheduler.throughput_history import TokenHistory

PREFIX = "tokenfleet:"
LABELS = ("model_name", "scheduler")
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Speculative decoding's counters (scheduler/speculative/speculator.py): metric name -> what it counts.
SPEC_DECODE_COUNTERS = (("num_drafts", "decodes that carried drafts"),
                        ("num_draft_tokens", "draft tokens proposed and verified"),
                        ("num_accepted_tokens", "draft tokens accepted"),
                        ("num_emitted_tokens", "tokens emitted by decodes with drafts"),
                        # ours: the expected-gain rule at work (scheduler/speculative/gain.py)
                        ("num_lookups", "decodes that looked for drafts, found or not"),
                        ("num_backoffs", "requests that stopped speculating where it did not pay"),
                        ("num_resumes", "backed-off requests that speculated again"))
# Attributes the block manager has once it caches prefixes (cumulative token counts); read
# with a default so these metrics exist, at 0, before it does.
PREFIX_CACHE_COUNTERS = (("prefix_cache_queries", "prompt tokens looked up in the prefix cache"),
                         ("prefix_cache_hits", "prompt tokens found in the prefix cache"))


class _SchedulerState(Collector):
    """Gauges and counters read from the scheduler at collection time."""

    def __init__(self, scheduler: Scheduler, labels: list[str]) -> None:
        self.scheduler = scheduler
        self.labels = labels

    def collect(self):
        scheduler, labels = self.scheduler, self.labels
        for name, doc, value in (
            ("num_requests_running", "requests in the running batch", scheduler.num_running_requests),
            ("num_requests_waiting", "requests waiting for a slot (preempted ones included)",
             scheduler.num_waiting_requests),
            ("kv_cache_usage_perc", "fraction of KV cache blocks in use, 0 to 1",
             scheduler.block_manager.usage),
        ):
            family = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
            family.add_metric(labels, value)
            yield family
        for name, doc in PREFIX_CACHE_COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
            family.add_metric(labels, getattr(scheduler.block_manager, name, 0))
            yield family
        slots = scheduler.lora_slots
        if slots is not None:  # an engine serving LoRA adapters
            family = GaugeMetricFamily(PREFIX + "lora_adapters_loaded", "LoRA adapters in a device slot now",
                                       labels=LABELS)
            family.add_metric(labels, len(slots.loaded_names()))
            yield family
            family = CounterMetricFamily(PREFIX + "lora_requests", "requests added on each LoRA adapter",
                                         labels=[*LABELS, "lora_name"])
            for lora_name, count in sorted(slots.num_requests.items()):
                family.add_metric([*labels, lora_name], count)
            yield family
        if scheduler.speculator is not None:
            yield from _spec_decode_families(scheduler.speculator, labels)
        if scheduler.host_tier is not None:
            yield from _host_tier_families(scheduler.host_tier, labels)


# Host KV tier counters: metric name -> (HostTierCounters field, what it counts).
HOST_TIER_COUNTERS = (
    ("external_prefix_cache_hits", "num_hit_tokens", "prompt tokens loaded from the host KV tier"),
    ("kv_offload_stored_blocks", "num_stored_blocks", "KV blocks copied to the host tier"),
    ("kv_offload_loaded_blocks", "num_loaded_blocks", "KV blocks loaded back from the host tier"),
    ("kv_offload_stored_bytes", "num_stored_bytes", "bytes copied to the host tier, every rank's"),
    ("kv_offload_loaded_bytes", "num_loaded_bytes", "bytes loaded from the host tier, every rank's"),
    ("kv_offload_load_seconds", "load_seconds", "seconds the driver rank's loads took (bytes / seconds: "
                                                "the load rate)"),
)


def _host_tier_families(host_tier, labels: list[str]):
    for name, field, doc in HOST_TIER_COUNTERS:
        family = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
        family.add_metric(labels, getattr(host_tier.counters, field))
        yield family
    family = GaugeMetricFamily(PREFIX + "kv_offload_usage_perc", "fraction of the host tier's blocks in use, "
                               "0 to 1", labels=LABELS)
    family.add_metric(labels, host_tier.usage)
    yield family


def _spec_decode_families(speculator, labels: list[str]):
    for name, doc in SPEC_DECODE_COUNTERS:
        family = CounterMetricFamily(PREFIX + "spec_decode_" + name, doc, labels=LABELS)
        family.add_metric(labels, getattr(speculator, name))
        yield family
    family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                 "draft tokens accepted, by position in the run",
                                 labels=[*LABELS, "position"])
    for position, count in enumerate(speculator.num_accepted_tokens_per_pos):
        family.add_metric([*labels, str(position)], count)
    yield family


class EngineMetrics:
    """One engine's metrics in a registry of its own (several engines may share a process)."""

    def __init__(self, scheduler: Scheduler, model_name: str, scheduler_id: str) -> None:
        self.registry = CollectorRegistry()
        labels = [model_name, scheduler_id]
        r = self.registry
        self._preemptions = Counter(PREFIX + "num_preemptions", "requests preempted (their KV freed, to "
                                    "be recomputed)", LABELS, registry=r).labels(*labels)
        self._prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of requests that started "
                                      "generating", LABELS, registry=r).labels(*labels)
        self._generation_tokens = Counter(PREFIX + "generation_tokens", "tokens generated", LABELS,
                                          registry=r).labels(*labels)
        success = Counter(PREFIX + "request_success", "requests that ended, by finish reason",
                          [*LABELS, "finished_reason"], registry=r)
        self._success = {reason: success.labels(*labels, reason.value) for reason in FinishReason}
        self._step_duration = Histogram(PREFIX + "step_duration_seconds", "one engine step: schedule, "
                                        "run on the workers, take the result back", LABELS,
                                        buckets=_STEP_BUCKETS, registry=r).labels(*labels)
        # Its rate is the share of wall time the engine's thread waits for the workers: near 1 the
        # GPU is what limits, near 0 the host (scheduling, launching) does.
        self._result_wait = Counter(PREFIX + "engine_result_wait_seconds", "time the engine's thread was "
                                    "blocked on a step's result from the workers (the GPU's time it did not "
                                    "overlap)", LABELS, registry=r).labels(*labels)
        self._iteration_tokens = Histogram(PREFIX + "iteration_tokens_total", "tokens computed per step",
                                           LABELS, buckets=_ITERATION_TOKEN_BUCKETS,
                                           registry=r).labels(*labels)
        r.register(_SchedulerState(scheduler, labels))
        self.scheduler = scheduler
        # Plain totals as well, for the throughput log and the heartbeat.
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished = 0
        self.generation_history = TokenHistory()  # tokens generated per wall-clock second
        self._started_req_ids: set[str] = set()  # requests whose prompt tokens are counted

    def record_step(self, output: SchedulerOutput, outputs: list[RequestOutput], duration_s: float,
                    result_wait_s: float = 0.0) -> None:
        """What one step did (called by the engine after the step)."""
        if result_wait_s:
            self._result_wait.inc(result_wait_s)
        if output.preempted_req_ids:
            self._preemptions.inc(len(output.preempted_req_ids))
        num_prompt = 0
        for work in output.batch.works:
            if work.is_sampled and work.req_id not in self._started_req_ids:
                self._started_req_ids.add(work.req_id)
                # The sampled chunk reaches the last known token: prompt + output so far.
                num_prompt += work.start_pos + len(work.token_ids) - work.num_output_tokens
        num_generated = 0
        for out in outputs:
            num_generated += len(out.new_token_ids)
            if out.finished:
                self._started_req_ids.discard(out.req_id)
                self._success[out.finish_reason or FinishReason.ABORT].inc()
                self.num_finished += 1
        if num_prompt:
            self._prompt_tokens.inc(num_prompt)
            self.num_prompt_tokens += num_prompt
        if num_generated:
            self._generation_tokens.inc(num_generated)
            self.num_generation_tokens += num_generated
            self.generation_history.add(time.time(), num_generated)
        if output.batch.works:
            self._step_duration.observe(duration_s)
            self._iteration_tokens.observe(sum(output.num_scheduled_tokens.values()))

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric, as of now."""
        return generate_latest(self.registry)
