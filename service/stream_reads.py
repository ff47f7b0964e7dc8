"""Reading many request streams at once, on one server or a Redis Cluster.

One server: one XREADGROUP names every stream (COUNT applies to each, so the room is shared
out), blocking if asked. A cluster refuses a command whose keys span slots, so the streams are
read with one XREADGROUP per partition (each partition's streams share its hash tag), all in one
pipeline (redis-py sends each shard its part at once). A blocking read there cannot block in
Redis (a pipeline's blocked reads would wait one after another on a shard): it reads without
blocking and, while nothing came, looks again every CLUSTER_POLL_S until the block time is up.
"""

from __future__ import annotations

import time

import redis

from protocol.keys import CONSUMER_GROUP, Keys
from shared.redis_client import is_cluster_client

CLUSTER_POLL_S = 0.01

Entry = tuple[str, str, dict]  # (stream, entry id, fields)


def queue_reads(client, pipe, consumer: str, streams: list[str], room: int, block_ms: int | None) -> int:
    """Queue the XREADGROUPs of `streams` on `pipe`, COUNT the room shared out; returns how many
    replies they add to the pipeline's (parse them with `entries`)."""
    count = max(1, -(-room // max(1, len(streams))))
    if not is_cluster_client(client):
        pipe.xreadgroup(CONSUMER_GROUP, consumer, {s: ">" for s in streams}, count=count, block=block_ms)
        return 1
    by_partition: dict[int, list[str]] = {}
    for stream in streams:
        by_partition.setdefault(Keys.partition_of_key(stream), []).append(stream)
    for group in by_partition.values():
        pipe.xreadgroup(CONSUMER_GROUP, consumer, {s: ">" for s in group}, count=count)
    return len(by_partition)


def entries(replies: list) -> list[Entry]:
    """(stream, entry id, fields) of XREADGROUP replies."""
    return [(s.decode(), eid.decode(), fields) for reply in replies
            for s, items in reply or [] for eid, fields in items]


def read(client, consumer: str, streams: list[str], room: int, block_ms: int | None) -> list[Entry]:
    """Read the streams now (or block up to block_ms until something comes)."""
    if not streams:
        return []
    deadline = time.monotonic() + (block_ms or 0) / 1000
    while True:
        pipe = client.pipeline(transaction=False)
        queue_reads(client, pipe, consumer, streams, room, block_ms)
        found = entries(pipe.execute())
        if found or not block_ms or not is_cluster_client(client) or time.monotonic() >= deadline:
            return found
        time.sleep(CLUSTER_POLL_S)


def create_groups(client, streams: list[str]) -> None:
    """The schedulers' consumer group on each stream (made with the stream where it is missing)."""
    for stream in streams:
        try:
            client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
