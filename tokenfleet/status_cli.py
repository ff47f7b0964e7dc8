"""`tokenfleet status [--json]`: the fleet at a glance, from Redis alone (like `ray status`).

The view is gateway/api/ops/fleet_view.py's, the same one the gateway's status page polls."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from redis.exceptions import RedisError

from gateway.api.ops.fleet_view import collect_fleet_view
from protocol.keys import keys_for
from shared.errors import TokenfleetError
from shared.redis_client import connect_async
from shared.redis_url import redacted


async def _read(redis_url: str, prefix: str) -> dict:
    client = connect_async(redis_url, socket_connect_timeout=5, socket_timeout=10)
    try:
        return await collect_fleet_view(client, keys_for(redis_url, prefix))
    finally:
        await client.aclose()


def run_status_command(args: argparse.Namespace) -> int:
    try:
        view = asyncio.run(_read(args.redis_url, args.key_prefix))
    except (RedisError, OSError) as exc:
        raise TokenfleetError(f"cannot read the fleet from {redacted(args.redis_url)}: {exc}") from None
    if args.json:
        print(json.dumps(view, indent=2))
    else:
        print(format_view(view, redacted(args.redis_url)))
    return 0


def _table(headers: list[str], rows: list[list], empty: str) -> list[str]:
    if not rows:
        return [f"  ({empty})"]
    cells = [[str(c) for c in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _speculation(s: dict) -> str:
    """Speculative decoding's acceptance rate and mean accepted length (tokens per verify), or -."""
    drafts, drafted, accepted = (s.get(k, 0) for k in ("spec_num_drafts", "spec_num_draft_tokens",
                                                       "spec_num_accepted_tokens"))
    if not drafted:
        return "-"
    return f"{100 * accepted / drafted:.0f}%/{1 + accepted / drafts:.2f}"


def _kv_use(s: dict) -> str:
    """GPU KV use, and the host tier's (with the prompt tokens it served) when there is one."""
    text = f"{100 * s['kv_usage']:.1f}%"
    if s.get("num_host_kv_blocks"):
        hits = s.get("host_kv_hit_tokens", 0)
        text += f" +host {100 * s.get('host_kv_usage', 0.0):.1f}% ({hits:,} hit tok)"
    return text


def format_view(view: dict, redis_url: str) -> str:
    totals = view["totals"]
    at = time.strftime("%H:%M:%S", time.localtime(view["time"]))
    out = [f"======== tokenfleet status: {redis_url} ({at}) ========",
           f"{totals['schedulers']} scheduler(s), {totals['gateways']} gateway(s); "
           f"{totals['num_running']} running, {totals['num_waiting']} waiting in schedulers, "
           f"{totals['queued']} queued in Redis; "
           f"{_rate(totals['generation_tokens_per_s'])} generation tok/s, "
           f"{_rate(totals['prompt_tokens_per_s'])} prompt tok/s; "
           f"prefix-cache hit rate {_percent(totals.get('prefix_cache_hit_rate'))}", "", "Schedulers:"]
    columns = ["ID", "MODEL", "TPxPP", "RUNNING", "WAITING", "KV", "GEN TOK/S", "FINISHED", "HIT RATE",
               "ROUTED/STOLEN/FALLBACK", "SPEC ACCEPT/LEN", "HEARTBEAT"]
    out += _table(columns, [
        [s["id"], s["model"], f"{s['tp']}x{s.get('pp', 1)}", f"{s['num_running']}/{s['max_num_seqs']}",
         s["num_waiting"],
         _kv_use(s), _rate(s["generation_tokens_per_s"]), s["num_finished"],
         _percent(s["prefix_cache_hits"] / s["prefix_cache_queries"] if s["prefix_cache_queries"] else None),
         f"{s.get('entries_routed', 0)}/{s.get('entries_stolen', 0)}/{s.get('entries_fallback', 0)}",
         _speculation(s), f"{s['heartbeat_age_s']:.1f}s ago"]
        for s in view["schedulers"]], "no live scheduler")
    with_loras = [s for s in view["schedulers"] if s.get("loras")]
    if with_loras:
        out += ["", "LoRA adapters (in a device slot / served):"]
        out += [f"  {s['id']}: {', '.join(s['loras_loaded']) or '-'} / {', '.join(s['loras'])}"
                for s in with_loras]
    out += ["", "Queues:"]
    out += _table(["MODEL", "KIND", "LENGTH", "PENDING", "QUEUED", "CONSUMERS"], [
        [q["model"], q["kind"], q["length"], q["pending"], q["queued"], q["consumers"]]
        for q in view["queues"]],
        "no request stream")
    dead = view["dead_letters"]
    out += ["", f"Dead letters: {dead['count']}"]
    for letter in dead["recent"]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(letter["at"]))
        out.append(f"  {when}  {letter.get('req_id') or '-'}  {letter['reason']}")
    out += ["", "Batch jobs:"]
    out += _table(["ID", "MODEL", "STATUS", "PROGRESS"], [
        [j["id"], j["model"] or "-", j["status"],
         f"{j['completed'] + j['failed']}/{j['total']} ({100 * j['progress']:.0f}%)"
         + (f", {j['failed']} failed" if j["failed"] else "")] for j in view["batch_jobs"]], "no batch job")
    out += [f"  {j['id']}: {j['error']}" for j in view["batch_jobs"] if j.get("error")]
    out += ["", "Gateways:"]
    out += _table(["ID", "ADDRESS", "MODELS", "HEARTBEAT"], [
        [g["id"], f"{g['host']}:{g['port']}", ",".join(g["models"]), f"{g['heartbeat_age_s']:.1f}s ago"]
        for g in view["gateways"]], "no gateway heartbeat")
    out += ["", "Redis:"]
    out += _table(["PRIMARY", "SLOTS", "REPLICAS", "OPS/S", "CPU S", "MEMORY"], [
        [r["primary"], "-" if r.get("slots") is None else r["slots"],
         ", ".join(f"{x['address']} ({x['health']})" for x in r.get("replicas", [])) or "-",
         r.get("instantaneous_ops_per_sec", "-"), r.get("cpu_s", "-"), _bytes(r.get("used_memory"))]
        + ([f"error: {r['error']}"] if r.get("error") else []) for r in view.get("redis", [])],
        "no Redis shard")
    return "\n".join(out)


def _bytes(value) -> str:
    if value is None:
        return "-"
    return f"{int(value) / 2**20:.1f} MiB"
