"""What the autoscaler reads from Redis for one model: its queue and its schedulers' heartbeats.

Queued entries (over the model's plain streams and its tenants' ones): a scheduler deletes an
entry when it acknowledges it, so XLEN minus the
group's pending count is what no scheduler has read yet (Redis 6.2 has no group `lag`). The
oldest of them is the first entry after the group's last-delivered id; its id holds its age.
"""

from __future__ import annotations

import time

import redis

from protocol import registry
from protocol.keys import CONSUMER_GROUP, REQUEST_KINDS, Keys
from tokenfleet.autoscale.policy import FleetSignals, ReplicaLoad


def read_signals(client: redis.Redis, keys: Keys, model: str, *, now: float | None = None) -> FleetSignals:
    now = time.time() if now is None else now
    num_queued, oldest_ms = 0, None
    # Each tenant's requests queue in a stream of their own (service/tenant_streams.py).
    members = client.smembers(keys.tenants(model))
    tenants = sorted(t.decode() if isinstance(t, bytes) else t for t in members)
    streams = [stream for kind in REQUEST_KINDS for tenant in [None, *tenants]
               for stream in keys.request_streams(model, kind, tenant)]
    # Requests routed to one replica queue in its own stream (gateway/fleet/routing.py).
    replicas = sorted(r.decode() for r in client.smembers(keys.replica_streams(model)))
    streams += [keys.replica_stream(model, r) for r in replicas]
    for stream in streams:
        queued, first_ms = _queued(client, stream)
        num_queued += queued
        if first_ms is not None:
            oldest_ms = first_ms if oldest_ms is None else min(oldest_ms, first_ms)
    age = max(0.0, now - oldest_ms / 1000) if oldest_ms is not None else 0.0
    return FleetSignals(num_queued=num_queued, oldest_queued_age_s=age,
                        replicas=tuple(read_heartbeats(client, keys, model)))


def _queued(client: redis.Redis, stream: str) -> tuple[int, int | None]:
    """(entries no scheduler has read, the oldest one's time in ms or None)."""
    pipe = client.pipeline(transaction=False)
    pipe.xlen(stream)
    pipe.execute_command("XINFO", "GROUPS", stream)
    try:
        length, groups = pipe.execute(raise_on_error=True)
    except redis.ResponseError:  # no stream yet
        return 0, None
    group = next((g for g in groups if _field(g, "name") == CONSUMER_GROUP), None)
    if group is None:
        first = client.xrange(stream, count=1)
        return length, _entry_ms(first[0][0]) if first else None
    pending = int(_field(group, "pending"))
    queued = max(0, length - pending)
    if queued == 0:
        return 0, None
    after = client.xrange(stream, min=f"({_field(group, 'last-delivered-id')}", count=1)
    return queued, _entry_ms(after[0][0]) if after else None


def _field(group, name: str):
    """A field of one XINFO GROUPS answer (a dict, or a flat list, by redis-py version)."""
    if isinstance(group, dict):
        value = group.get(name, group.get(name.encode()))
    else:
        items = dict(zip(group[::2], group[1::2], strict=True))
        value = items.get(name.encode(), items.get(name))
    return value.decode() if isinstance(value, bytes) else value


def _entry_ms(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-")[0])


def read_heartbeats(client: redis.Redis, keys: Keys, model: str) -> list[ReplicaLoad]:
    """The live schedulers of `model`, from the registry (a heartbeat expires a few seconds
    after its scheduler)."""
    live = registry.read_live(client, keys, [registry.SCHEDULERS])[registry.SCHEDULERS]
    replicas = []
    for name, beat in sorted(live.items()):
        if beat.get(b"model", b"") != model.encode():
            continue
        try:
            replicas.append(ReplicaLoad(
                replica_id=name, num_running=int(beat.get(b"num_running", 0)),
                num_waiting=int(beat.get(b"num_waiting", 0)), max_num_seqs=int(beat.get(b"max_num_seqs", 1)),
                is_draining=beat.get(b"draining", b"0") == b"1",
            ))
        except ValueError:
            continue  # a half-written or foreign hash: not a replica we can count
    return replicas
