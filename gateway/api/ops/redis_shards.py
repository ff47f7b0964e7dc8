"""The Redis the fleet runs on, shard by shard, for `tokenfleet status` and `/fleet.json`.

One server: one row. A cluster: one row per shard (CLUSTER SHARDS, Redis >= 7), its primary's
address, slot count, memory, commands per second and CPU seconds, and its replicas with their
replication state (a shard with no replica in sync loses what its primary had not sent yet,
docs/fault-tolerance.md).
"""

from __future__ import annotations

from redis.exceptions import RedisError

from shared.redis_client import is_cluster_client

INFO_FIELDS = ("used_memory", "instantaneous_ops_per_sec", "used_cpu_sys", "used_cpu_user",
               "connected_clients")


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _numbers(info: dict) -> dict:
    row = {name: info.get(name) for name in INFO_FIELDS}
    cpu = [info.get("used_cpu_sys"), info.get("used_cpu_user")]
    row["cpu_s"] = round(sum(float(c) for c in cpu if c is not None), 2)
    return {k: v for k, v in row.items() if k not in ("used_cpu_sys", "used_cpu_user")}


async def collect_shards(client) -> list[dict]:
    """One dict per shard: {"primary", "slots", "replicas": [{"address", "health"}], and the
    primary's INFO numbers}; an unreachable node shows as such, and never fails the view."""
    if not is_cluster_client(client):
        try:
            info = await client.info()
        except RedisError as exc:
            return [{"primary": "?", "error": str(exc)}]
        return [{"primary": "single server", "slots": None, "replicas": [], **_numbers(info)}]
    shards = []
    try:
        described = await client.execute_command("CLUSTER SHARDS", target_nodes=client.get_random_node())
    except RedisError as exc:
        return [{"primary": "?", "error": str(exc)}]
    for shard in described:
        shard = {_text(k): v for k, v in _pairs(shard).items()}
        slots = shard.get("slots", [])
        if slots and isinstance(slots[0], (list, tuple)):  # some servers and clients give [lo, hi] pairs
            slots = [bound for pair in slots for bound in pair]
        num_slots = sum(int(hi) - int(lo) + 1 for lo, hi in zip(slots[::2], slots[1::2], strict=True))
        nodes = [{_text(k): _text(v) for k, v in _pairs(node).items()} for node in shard.get("nodes", [])]
        primary = next((n for n in nodes if n.get("role") == "master" and n.get("health") == "online"), None)
        if primary is None:
            continue  # (a shard whose nodes are all gone, or no slots: nothing serves from it)
        address = f"{primary.get('ip') or primary.get('endpoint')}:{primary.get('port')}"
        row = {"primary": address, "slots": num_slots,
               "replicas": [{"address": f"{n.get('ip') or n.get('endpoint')}:{n.get('port')}",
                             "health": n.get("health")} for n in nodes if n.get("role") != "master"]}
        node = client.get_node(host=primary.get("ip") or primary.get("endpoint"), port=int(primary["port"]))
        try:
            info = await client.execute_command("INFO", target_nodes=node) if node is not None else {}
            row.update(_numbers(info if isinstance(info, dict) else {}))
        except RedisError as exc:
            row["error"] = str(exc)
        shards.append(row)
    return sorted(shards, key=lambda r: r["primary"])


def _pairs(value) -> dict:
    """A RESP2 flat [name, value, ...] list (or a dict already) as a dict."""
    if isinstance(value, dict):
        return value
    return dict(zip(value[::2], value[1::2], strict=True))
