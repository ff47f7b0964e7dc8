"""The fleet's registry of live processes: how anyone finds the schedulers and the gateways
without scanning the keyspace (whose size grows with the traffic: a day of `tf:res` records).

Each kind of process has a sorted set (Keys.registry): member the process's id, score the
moment its heartbeat lapses, in the Redis server's clock (registry_beat.lua), so that hosts
whose clocks differ agree. A process adds itself at every heartbeat, beside its own hash (which
keeps its TTL and carries what it reports), and removes itself when it stops cleanly. Readers
drop the lapsed members first (registry_list.lua), then read the hashes of the rest: a member
whose hash is gone (it died within the last TTL) or unreadable is left out, never an error.

Every registry carries one hash tag, so on a Redis Cluster they live in one slot: one script
call reads them all, on one shard, with no per-shard scan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from protocol.keys import Keys
from protocol.lua import Script

SCHEDULERS = "schedulers"  # member: scheduler id; its hash Keys.scheduler(id)
GATEWAYS = "gateways"  # member: gateway id (host-pid); its hash Keys.gateway(id)
REGISTRY_KINDS = (SCHEDULERS, GATEWAYS)
# Members returned per registry at most, soonest to lapse first: a registry stuffed by hand with
# far-future scores cannot make a listing unbounded, and the live processes come first.
MAX_MEMBERS = 10_000

_BEAT = Script("registry_beat")
_LIST = Script("registry_list")


def hash_key(keys: Keys, kind: str) -> Callable[[str], str]:
    """The per-process hash of a member of `kind`."""
    if kind == SCHEDULERS:
        return keys.scheduler
    if kind == GATEWAYS:
        return keys.gateway
    raise ValueError(f"registry kind {kind!r} is not one of {REGISTRY_KINDS}")


def _beat_call(keys: Keys, kind: str, member: str, ttl_s: float):
    hash_key(keys, kind)  # (an unknown kind is a bug: say so here, not in a reader)
    return [keys.registry(kind)], [member, f"{ttl_s:.3f}"]


def beat(client, keys: Keys, kind: str, member: str, ttl_s: float) -> None:
    """List `member` as alive for `ttl_s` more seconds (sync client)."""
    _BEAT.run(client, *_beat_call(keys, kind, member, ttl_s))


async def beat_async(client, keys: Keys, kind: str, member: str, ttl_s: float) -> None:
    await _BEAT.run_async(client, *_beat_call(keys, kind, member, ttl_s))


def _members(reply: Sequence, kinds: Sequence[str]) -> dict[str, list[str]]:
    """kind -> member ids; a member that is not UTF-8 text names no process of ours: skipped."""
    out: dict[str, list[str]] = {}
    for kind, raw in zip(kinds, reply, strict=True):
        names = []
        for member in raw or []:
            try:
                name = member.decode() if isinstance(member, bytes) else str(member)
            except UnicodeDecodeError:
                continue
            if name:
                names.append(name)
        out[kind] = names
    return out


def live_members(client, keys: Keys, kinds: Sequence[str] = REGISTRY_KINDS) -> dict[str, list[str]]:
    """kind -> ids of the members whose heartbeat has not lapsed (sync client)."""
    return _members(_LIST.run(client, [keys.registry(k) for k in kinds], [MAX_MEMBERS]), kinds)


async def live_members_async(client, keys: Keys,
                             kinds: Sequence[str] = REGISTRY_KINDS) -> dict[str, list[str]]:
    return _members(await _LIST.run_async(client, [keys.registry(k) for k in kinds], [MAX_MEMBERS]), kinds)


def _queue_reads(pipe, keys: Keys, members: dict[str, list[str]]) -> list[tuple[str, str]]:
    order = []
    for kind, ids in members.items():
        key_of = hash_key(keys, kind)
        for member in ids:
            pipe.hgetall(key_of(member))
            order.append((kind, member))
    return order


def _sort_hashes(order, raws, kinds) -> dict[str, dict[str, dict[bytes, bytes]]]:
    out: dict[str, dict[str, dict[bytes, bytes]]] = {kind: {} for kind in kinds}
    for (kind, member), raw in zip(order, raws, strict=True):
        if isinstance(raw, dict) and raw:  # (gone, or not a hash: left out)
            out[kind][member] = raw
    return out


def read_live(client, keys: Keys, kinds: Sequence[str] = REGISTRY_KINDS) -> dict[str, dict[str, dict]]:
    """kind -> member id -> its hash (raw bytes), for every live member whose hash is there."""
    members = live_members(client, keys, kinds)
    pipe = client.pipeline(transaction=False)
    order = _queue_reads(pipe, keys, members)
    return _sort_hashes(order, pipe.execute(raise_on_error=False) if order else [], kinds)


async def read_live_async(client, keys: Keys,
                          kinds: Sequence[str] = REGISTRY_KINDS) -> dict[str, dict[str, dict]]:
    members = await live_members_async(client, keys, kinds)
    pipe = client.pipeline(transaction=False)
    order = _queue_reads(pipe, keys, members)
    return _sort_hashes(order, await pipe.execute(raise_on_error=False) if order else [], kinds)


def leave(client, keys: Keys, kind: str, member: str) -> None:
    """Unlist `member` (a clean stop; its caller deletes its hash)."""
    client.zrem(keys.registry(kind), member)


async def leave_async(client, keys: Keys, kind: str, member: str) -> None:
    await client.zrem(keys.registry(kind), member)
