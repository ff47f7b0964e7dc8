"""What one gateway process is told: where Redis is, which models it fronts, its limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gateway.tenants.directory import TenantDirectory


@dataclass(frozen=True)
class ModelSpec:
    path: str  # Hugging Face model folder (tokenizer, chat template, config.json)
    name: str  # served model name: what clients put in "model"

    @classmethod
    def from_path(cls, path: str, name: str | None = None) -> ModelSpec:
        return cls(str(path), name or Path(path).name)


@dataclass
class GatewaySettings:
    redis_url: str
    models: list[ModelSpec]
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()  # none (and no tenants): the gateway is open
    tenants: TenantDirectory = field(default_factory=TenantDirectory.empty)  # their keys are accepted too
    tenants_from_redis: bool = False  # also look keys and limits up in Redis (gateway/tenants/registry.py)
    # /metrics and /fleet.json open to anyone even with API keys or tenants (--public-metrics),
    # e.g. for a Prometheus that scrapes without a key; off: they need a key (an admin's with tenants)
    public_metrics: bool = False
    # Folders a tenant's runtime LoRA load may read from (--lora-root); none: tenants may not load
    # adapters at runtime (callers with no tenant, and admins, may load any folder the schedulers read)
    lora_roots: tuple[str, ...] = ()
    tenant_lease_s: float = 3600.0  # a concurrency lease nothing ended (the request lost) lapses after this
    tenant_pending_lease_s: float = 60.0  # a lease taken, never queued (its gateway died), lapses after this
    key_prefix: str = "tf:"
    max_queue: int = 1024  # per model: waiting entries beyond this answer 429
    max_n: int = 8  # cap on "n" (choices per request)
    max_body_bytes: int = 4 << 20
    redis_max_connections: int = 64  # commands beyond this many at once wait for a connection
    retry_after_s: int = 1  # Retry-After of a 429
    result_ttl_s: int = 24 * 3600  # of the tf:res:{id} record the gateway creates
    cancel_ttl_s: int = 3600  # of tf:cancelled:{id}
    idempotency_ttl_s: int = 24 * 3600
    poll_s: float = 2.0  # a follower with no event for this long re-reads tf:res
    keepalive_s: float = 15.0  # SSE comment lines on idle streams, at most this far apart
    scheduler_grace_s: float = 10.0  # a scheduler seen this recently still counts as live
    fleet_refresh_s: float = 1.0  # how often heartbeats and queue depths are read
    # prefix: chats go to the replica caching their prefix (gateway/fleet/routing.py); none
    routing: str = "prefix"
    cancel_wait_s: float = 2.0  # DELETE waits this long for the terminal state
    # Batch jobs (gateway/api/batch/ingester.py, /v1/files, /v1/batches).
    batch_ingester: bool = True  # run a batch ingester inside this process
    batch_max_inflight: int = 1024  # per job: lines queued whose output is not written yet
    batch_max_lines: int = 1_000_000  # per job
    batch_lease_s: float = 10.0  # a job entry or notice pending this long is taken over
    max_file_bytes: int = 512 << 20  # an uploaded file (Redis caps a value at 512 MiB)
