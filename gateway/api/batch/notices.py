"""Reading the notices of finished batch items (`tf:batch:done`, written by the schedulers'
result write in the item's slot): one stream on one server, read blocking; on a Redis Cluster
one per partition (protocol/keys.py), read in one pipeline (each XREADGROUP names streams of one
slot only) and polled, since blocked reads in a pipeline would wait one after another."""

from __future__ import annotations

import asyncio

from protocol.keys import INGESTER_GROUP

POLL_S = 0.05  # on a cluster, how often an idle ingester looks again
BLOCK_MS = 1000  # on one server, how long one read waits


async def read_notices(client, consumer: str, streams: list[str], count: int = 512) -> list[tuple[str, list]]:
    """(stream, entries) of each stream with new notices for this consumer."""
    if len(streams) == 1:
        replies = [await client.xreadgroup(INGESTER_GROUP, consumer, {streams[0]: ">"}, count=count,
                                           block=BLOCK_MS)]
    else:
        pipe = client.pipeline(transaction=False)
        for stream in streams:
            pipe.xreadgroup(INGESTER_GROUP, consumer, {stream: ">"}, count=count)
        replies = await pipe.execute()
        if not any(replies):
            await asyncio.sleep(POLL_S)
    return [(stream.decode(), entries) for reply in replies for stream, entries in reply or []]
