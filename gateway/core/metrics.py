"""Prometheus metrics of the gateway: each app has its own registry (so apps never collide).

With several gateway processes on one port (`tokenfleet gateway --workers N`), the
processes run prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set by
gateway/http/supervisor.py), and /metrics, whichever process answers, renders the files of all
of them: counters and histograms summed, active_streams summed over the live processes,
the fleet's gauges (queue depth, live schedulers, active batch jobs) as last set.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_PHASES = (
    ("queue_time", "tokenfleet_gateway_queue_time_seconds", "queued until a scheduler started it",
     _LATENCY_BUCKETS),
    ("ttft", "tokenfleet_gateway_time_to_first_token_seconds", "request received until its first token left",
     _LATENCY_BUCKETS),
    ("itl", "tokenfleet_gateway_inter_token_latency_seconds", "between two token deliveries of one stream",
     _ITL_BUCKETS),
    ("e2e", "tokenfleet_gateway_e2e_request_latency_seconds", "request received until its last token left",
     _LATENCY_BUCKETS),
)


class GatewayMetrics:
    queue_time: Histogram
    ttft: Histogram
    itl: Histogram
    e2e: Histogram

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter("tokenfleet_gateway_http_requests", "HTTP requests by route and status",
                                     ["method", "route", "status"], registry=r)
        # One per choice of a completions call, at its end: completed, failed, expired, cancelled,
        # disconnected (the client left first) or rejected (refused before it was queued).
        self.requests = Counter("tokenfleet_gateway_requests",
                                "generation requests (choices of /v1/completions and /v1/chat/completions "
                                "calls) by model and end state", ["model", "status"], registry=r)
        # The request's phases, by model: name, help, buckets.
        for attr, name, doc, buckets in _PHASES:
            setattr(self, attr, Histogram(name, doc, ["model"], buckets=buckets, registry=r))
        self.active_streams = Gauge("tokenfleet_gateway_active_streams", "SSE responses open now",
                                    registry=r, multiprocess_mode="livesum")
        self.queue_depth = Gauge("tokenfleet_gateway_queue_depth",
                                 "entries of a model's interactive stream not yet taken", ["model"],
                                 registry=r, multiprocess_mode="mostrecent")
        self.tenant_refusals = Counter("tokenfleet_gateway_tenant_refusals",
                                       "calls refused for a tenant's limit (429), by tenant and limit",
                                       ["tenant", "limit"], registry=r)
        self.batch_lines = Counter("tokenfleet_batch_lines", "batch lines whose output this process wrote",
                                   ["status"], registry=r)
        self.batch_jobs = Counter("tokenfleet_batch_jobs", "batch jobs this process ended, by end state",
                                  ["status"], registry=r)
        self.batch_jobs_active = Gauge("tokenfleet_batch_jobs_active", "batch jobs taken in and not ended",
                                       registry=r, multiprocess_mode="mostrecent")
        self.live_schedulers = Gauge("tokenfleet_gateway_live_schedulers",
                                     "schedulers with a live heartbeat, per model", ["model"], registry=r,
                                     multiprocess_mode="mostrecent")
        self.prefix_cache_hit_rate = Gauge("tokenfleet_fleet_prefix_cache_hit_rate",
                                           "prompt tokens found in a prefix cache / looked up, over the "
                                           "model's live schedulers since they started", ["model"],
                                           registry=r, multiprocess_mode="mostrecent")
        self.routing_decisions = Counter("tokenfleet_gateway_routing_decisions",
                                         "where requests were queued: routed (a replica's own stream), "
                                         "no_match, overloaded or single (the shared stream)",
                                         ["model", "decision"], registry=r)

    def render(self) -> bytes:
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not directory:
            return generate_latest(self.registry)
        registry = CollectorRegistry()  # what every process of this gateway wrote
        multiprocess.MultiProcessCollector(registry, path=directory)
        return generate_latest(registry)
