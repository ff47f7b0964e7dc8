"""The fleet at a glance, read from Redis alone: what `tokenfleet status` prints and what the
gateway's status page (`/` and `/fleet.json`) shows. One function makes it for both.

    schedulers   tf:sched:{id} heartbeats: model, TP, load, KV use, tok/s, heartbeat age
    queues       each tf:req:{model}:{kind} stream: length, taken by a scheduler and not yet
                 acknowledged (pending), queued (length - pending), schedulers in its group
    dead letters tf:dead: how many, and the newest few
    batch jobs   the newest few of tf:batch:jobs: status and progress (and the first error of
                 a failed one, a corrupt record's included)
    gateways     tf:gw:{id} heartbeats
    totals       sums over the live schedulers, and their prefix-cache hit rate
    throughput_history
                 the fleet's generated tokens in each of the last 120 s (summed from the
                 per-second counts each scheduler puts in its heartbeat)
"""

from __future__ import annotations

import json
import time

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from gateway.batch.jobs import JobStore
from gateway.redis_shards import collect_shards
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


async def _hashes(client: aioredis.Redis, pattern: str) -> dict[str, dict[str, str]]:
    """key -> fields of every hash whose key matches."""
    keys = [key async for key in client.scan_iter(match=pattern, count=500)]
    if not keys:
        return {}
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hgetall(key)
    raws = await pipe.execute(raise_on_error=False)
    return {key.decode(): _text(raw) for key, raw in zip(keys, raws, strict=True)
            if isinstance(raw, dict) and raw}


def _scheduler(scheduler_id: str, f: dict[str, str], now: float) -> dict:
    return {
        "id": scheduler_id, "model": f.get("model", "?"),
        "tp": _num(f, "tp", int, 1), "pp": _num(f, "pp", int, 1),
        "host": f.get("host"), "pid": _num(f, "pid", int, None),
        "num_running": _num(f, "num_running", int), "num_waiting": _num(f, "num_waiting", int),
        "max_num_seqs": _num(f, "max_num_seqs", int), "kv_usage": _num(f, "kv_usage"),
        "num_kv_blocks": _num(f, "num_kv_blocks", int),
        "prompt_tokens_per_s": _num(f, "prompt_tokens_per_s"),
        "generation_tokens_per_s": _num(f, "generation_tokens_per_s"),
        "num_prompt_tokens": _num(f, "num_prompt_tokens", int),
        "num_generation_tokens": _num(f, "num_generation_tokens", int),
        "num_finished": _num(f, "num_finished", int),
        "prefix_cache_queries": _num(f, "prefix_cache_queries", int),
        "prefix_cache_hits": _num(f, "prefix_cache_hits", int),
        # Entries it started, by stream: its own (routed), a peer's (stolen), the shared ones.
        **{f"entries_{src}": _num(f, f"entries_{src}", int) for src in ("routed", "stolen", "fallback")},
        "heartbeat_age_s": round(max(0.0, now - _num(f, "updated_at", float, now)), 2),
    }


async def _queues(client: aioredis.Redis, keys: Keys, models: set[str]) -> list[dict]:
    """One row per model and kind; every partition's stream, a tenant's (..:{kind}:t:{tenant})
    and a replica's own one (..:interactive:r:{id}) count in their kind."""
    streams: dict[tuple[str, str], list[str]] = {}
    for key in [k.decode() async for k in client.scan_iter(match=keys.request_stream_pattern, count=500)]:
        name = keys.parse_request_stream(key)
        if name is not None:
            models.add(name.model)
            streams.setdefault((name.model, name.kind), []).append(key)
    queues = []
    for model in sorted(models):
        for kind in REQUEST_KINDS:
            row = {"model": model, "kind": kind, "length": 0, "pending": 0, "queued": 0, "consumers": 0}
            for stream in sorted(streams.get((model, kind), [])):
                pipe = client.pipeline(transaction=False)
                pipe.xlen(stream)
                pipe.xinfo_groups(stream)
                length, groups = await pipe.execute(raise_on_error=False)
                length = 0 if isinstance(length, Exception) else int(length)
                group = {}
                if not isinstance(groups, ResponseError):  # (no such stream yet)
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
    scheduler_prefix = len(keys.scheduler(""))
    hashes = await _hashes(client, keys.scheduler_pattern)
    heartbeats = {key[scheduler_prefix:]: fields for key, fields in hashes.items() if "model" in fields}
    schedulers = sorted((_scheduler(name, fields, now) for name, fields in heartbeats.items()),
                        key=lambda s: (s["model"], s["id"]))
    gateway_prefix = len(keys.gateway(""))
    gateways = sorted((_gateway(key[gateway_prefix:], fields, now)
                       for key, fields in (await _hashes(client, keys.gateway_pattern)).items()),
                      key=lambda g: g["id"])
    queues = await _queues(client, keys, {s["model"] for s in schedulers})
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
