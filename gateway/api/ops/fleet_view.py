"""The fleet at a glance, read from Redis alone: what `tokenfleet status` prints and what the
gateway's status page (`/` and `/fleet.json`) shows. One function makes it for both.

    schedulers   tf:sched:{id} heartbeats of the registry's live schedulers (protocol/registry.py):
                 model, TP, load, KV use, tok/s, heartbeat age
    queues       each tf:req:{model}:{kind} stream of the models they serve and the gateways
                 front: length, taken by a scheduler and not yet acknowledged (pending), queued
                 (length - pending), schedulers in its group
    dead letters tf:dead: how many, and the newest few
    batch jobs   the newest few of tf:batch:jobs: status and progress (and the first error of
                 a failed one, a corrupt record's included)
    gateways     tf:gw:{id} heartbeats of the registry's live gateways
    totals       sums over the live schedulers, and their prefix-cache hit rate
Nothing here scans the keyspace: its cost follows the fleet's size, not the number of keys.
    throughput_history
                 the fleet's generated tokens in each of the last 120 s (summed from the
                 per-second counts each scheduler puts in its heartbeat)
"""

from __future__ import annotations

import json
import time

import redis.asyncio as aioredis

from gateway.api.batch.jobs import JobStore
from gateway.api.ops.redis_shards import collect_shards
from protocol import registry
from protocol.keys import CONSUMER_GROUP, REQUEST_KINDS, Keys
from protocol.messages import DeadLetter, MessageDecodeError

MAX_JOBS = 20
MAX_DEAD_LETTERS = 5
HISTORY_S = 120
# The newest seconds are still being counted (and reach Redis at the next heartbeat): the
# history ends this many seconds before now.
HISTORY_LAG_S = 2


def _text(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode(errors="replace") for k, v in raw.items()}


def _num(fields: dict[str, str], name: str, kind=float, default=0):
    try:
        return kind(fields[name])
    except (KeyError, ValueError):
        return default


def _scheduler(scheduler_id: str, f: dict[str, str], now: float) -> dict:
    return {
        "id": scheduler_id, "model": f.get("model", "?"),
        "tp": _num(f, "tp", int, 1), "pp": _num(f, "pp", int, 1),
        "host": f.get("host"), "pid": _num(f, "pid", int, None),
        "num_running": _num(f, "num_running", int), "num_waiting": _num(f, "num_waiting", int),
        "max_num_seqs": _num(f, "max_num_seqs", int), "kv_usage": _num(f, "kv_usage"),
        "num_kv_blocks": _num(f, "num_kv_blocks", int),
        # The host KV tier (0 blocks: none): its use, prompt tokens loaded from it, its load traffic.
        "num_host_kv_blocks": _num(f, "num_host_kv_blocks", int), "host_kv_usage": _num(f, "host_kv_usage"),
        "host_kv_hit_tokens": _num(f, "host_kv_hit_tokens", int),
        "host_kv_loaded_bytes": _num(f, "host_kv_loaded_bytes", int),
        "host_kv_load_seconds": _num(f, "host_kv_load_seconds"),
        "prompt_tokens_per_s": _num(f, "prompt_tokens_per_s"),
        "generation_tokens_per_s": _num(f, "generation_tokens_per_s"),
        "num_prompt_tokens": _num(f, "num_prompt_tokens", int),
        "num_generation_tokens": _num(f, "num_generation_tokens", int),
        "num_finished": _num(f, "num_finished", int),
        "prefix_cache_queries": _num(f, "prefix_cache_queries", int),
        "prefix_cache_hits": _num(f, "prefix_cache_hits", int),
        # Speculative decoding's totals (0 without it).
        **{name: _num(f, name, int) for name in ("spec_num_drafts", "spec_num_draft_tokens",
                                                  "spec_num_accepted_tokens")},
        # Entries it started, by stream: its own (routed), a peer's (stolen), the shared ones.
        **{f"entries_{src}": _num(f, f"entries_{src}", int) for src in ("routed", "stolen", "fallback")},
        "heartbeat_age_s": round(max(0.0, now - _num(f, "updated_at", float, now)), 2),
        # LoRA adapters it serves, and those in a device slot now
        "loras": _names(f, "loras"), "loras_loaded": _names(f, "loras_loaded"),
    }


def _names(fields: dict[str, str], name: str) -> list[str]:
    try:
        names = json.loads(fields.get(name, "[]"))
    except ValueError:
        return []
    return [str(n) for n in names] if isinstance(names, list) else []


async def _streams(client: aioredis.Redis, keys: Keys, model: str) -> dict[str, list[str]]:
    """kind -> the model's request streams: every partition's plain one, each tenant's (its
    tenants set) and each replica's own one (its routed set), named from those sets, never
    found by a scan."""
    pipe = client.pipeline(transaction=False)
    pipe.smembers(keys.tenants(model))
    pipe.smembers(keys.replica_streams(model))
    tenants, replicas = await pipe.execute()
    streams = {}
    for kind in REQUEST_KINDS:
        streams[kind] = [stream for tenant in [None, *sorted(t.decode() for t in tenants)]
                         for stream in keys.request_streams(model, kind, tenant)]
    streams["interactive"] += [keys.replica_stream(model, r.decode()) for r in sorted(replicas)]
    return streams


async def _queues(client: aioredis.Redis, keys: Keys, models: set[str]) -> list[dict]:
    """One row per model and kind; every partition's stream, a tenant's (..:{kind}:t:{tenant})
    and a replica's own one (..:interactive:r:{id}) count in their kind."""
    queues = []
    for model in sorted(models):
        streams = await _streams(client, keys, model)
        for kind in REQUEST_KINDS:
            row = {"model": model, "kind": kind, "length": 0, "pending": 0, "queued": 0, "consumers": 0}
            pipe = client.pipeline(transaction=False)
            for stream in streams[kind]:
                pipe.xlen(stream)
                pipe.xinfo_groups(stream)
            replies = await pipe.execute(raise_on_error=False)
            for length, groups in zip(replies[::2], replies[1::2], strict=True):
                length = 0 if isinstance(length, Exception) else int(length)
                group = {}
                if not isinstance(groups, Exception):  # (no such stream yet)
                    group = next((g for g in groups if _decoded(g.get("name")) == CONSUMER_GROUP), {})
                pending = int(group.get("pending", 0))
                row["length"] += length
                row["pending"] += pending
                row["queued"] += max(0, length - pending)
                row["consumers"] = max(row["consumers"], int(group.get("consumers", 0)))
            queues.append(row)
    return queues


def _decoded(value) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


async def _dead_letters(client: aioredis.Redis, keys: Keys) -> dict:
    pipe = client.pipeline(transaction=False)
    pipe.xlen(keys.dead)
    pipe.xrevrange(keys.dead, count=MAX_DEAD_LETTERS)
    count, entries = await pipe.execute()
    recent = []
    for entry_id, fields in entries:
        item = {"at": int(entry_id.decode().split("-")[0]) / 1000}
        try:
            letter = DeadLetter.decode(fields[b"m"])
            item.update(req_id=letter.req_id, reason=letter.reason, stream=letter.stream,
                        num_deliveries=letter.num_deliveries)
        except (KeyError, MessageDecodeError):
            item.update(reason="(unreadable entry)")
        recent.append(item)
    return {"count": int(count), "recent": recent}


async def _batch_jobs(client: aioredis.Redis, keys: Keys) -> list[dict]:
    """The newest jobs; a corrupt record shows as failed with its error (jobs.py reads it leniently)."""
    jobs, _ = await JobStore(client, keys).list(limit=MAX_JOBS)
    rows = []
    for job in jobs:
        batch = job.to_openai()
        counts = batch["request_counts"]
        written = counts["completed"] + counts["failed"]
        errors = (batch["errors"] or {}).get("data") or []
        rows.append({"id": job.id, "model": job.model, "status": batch["status"], **counts,
                     "progress": round(min(1.0, written / counts["total"]), 4) if counts["total"] else 0.0,
                     "created_at": batch["created_at"], "error": errors[0]["message"] if errors else None})
    return rows


def _gateway(gateway_id: str, f: dict[str, str], now: float) -> dict:
    try:
        models = json.loads(f.get("models", "[]"))
    except json.JSONDecodeError:
        models = []
    if not isinstance(models, list):
        models = []
    return {"id": gateway_id, "host": f.get("host"), "port": _num(f, "port", int, None),
            "hostname": f.get("hostname"), "pid": _num(f, "pid", int, None), "models": models,
            "heartbeat_age_s": round(max(0.0, now - _num(f, "updated_at", float, now)), 2)}


def _history(heartbeats: list[dict[str, str]], now: float) -> dict:
    end = int(now) - HISTORY_LAG_S  # the last second shown
    tokens = [0] * HISTORY_S
    for fields in heartbeats:
        try:
            pairs = json.loads(fields.get("generation_history", "[]"))
        except json.JSONDecodeError:
            continue
        for second, count in pairs:
            index = int(second) - (end - HISTORY_S + 1)
            if 0 <= index < HISTORY_S:
                tokens[index] += int(count)
    return {"end": end, "generation_tokens": tokens}


def _hit_rate(schedulers: list[dict]) -> float | None:
    """Prompt tokens found in a prefix cache over those looked up, fleet-wide (None: none yet)."""
    queries = sum(s["prefix_cache_queries"] for s in schedulers)
    return round(sum(s["prefix_cache_hits"] for s in schedulers) / queries, 4) if queries else None


async def collect_fleet_view(client: aioredis.Redis, keys: Keys) -> dict:
    """Everything above as one JSON-able dict (sorted, so two reads compare)."""
    now = time.time()
    live = await registry.read_live_async(client, keys)
    heartbeats = {name: fields for name, raw in live[registry.SCHEDULERS].items()
                  if "model" in (fields := _text(raw))}
    schedulers = sorted((_scheduler(name, fields, now) for name, fields in heartbeats.items()),
                        key=lambda s: (s["model"], s["id"]))
    gateways = sorted((_gateway(name, _text(raw), now) for name, raw in live[registry.GATEWAYS].items()),
                      key=lambda g: g["id"])
    # The queues of every model a live scheduler serves or a live gateway fronts.
    models = {s["model"] for s in schedulers}
    models |= {m for g in gateways for m in g["models"] if isinstance(m, str)}
    queues = await _queues(client, keys, models)
    totals = {
        "schedulers": len(schedulers), "gateways": len(gateways),
        "num_running": sum(s["num_running"] for s in schedulers),
        "num_waiting": sum(s["num_waiting"] for s in schedulers),
        "queued": sum(q["queued"] for q in queues),
        "prompt_tokens_per_s": round(sum(s["prompt_tokens_per_s"] for s in schedulers), 2),
        "generation_tokens_per_s": round(sum(s["generation_tokens_per_s"] for s in schedulers), 2),
        "prefix_cache_hit_rate": _hit_rate(schedulers),
    }
    return {"time": now, "totals": totals, "schedulers": schedulers, "queues": queues,
            "dead_letters": await _dead_letters(client, keys), "batch_jobs": await _batch_jobs(client, keys),
            "gateways": gateways, "throughput_history": _history(list(heartbeats.values()), now),
            "redis": await collect_shards(client)}
