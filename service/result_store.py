"""The one atomic write that updates each request's `tf:res:{id}` record (protocol/result_record.py).

Each step, one Lua call per partition (protocol/keys.py: one on one server) takes every
request of it that moved and, for each, checks that this scheduler still owns the request,
mirrors the new state into the hash, publishes the event on `tf:ev:{P}:{id}` (SPUBLISH on a
cluster) and, for a terminal state, acknowledges the stream entry; every call goes in one
pipeline. The tenant leases of requests that ended are removed right after, from the tenants'
keys (a scheduler that dies in between leaves them to lapse, as gateway/tenants/limits.py says).
Ownership fencing is what makes takeover safe: once a successor has claimed
a request, a slow predecessor's writes are refused instead of interleaving.

A batch item's terminal write also appends a notice to `tf:batch:done` (its partition's on a
cluster), in the same call and
only on the first terminal write, so the batch ingesters learn of every finished item exactly
when (and as surely as) its result exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import redis

from protocol import lua
from protocol.keys import CONSUMER_GROUP, Keys
from protocol.messages import TERMINAL_STATES
from protocol.result_record import F, StoredProgress, is_terminal_write
from shared.redis_client import is_cluster_client, unreplicated


# The step's write and the admission's claim (their keys and arguments are named in each
# script's header); the sharded variant publishes with SPUBLISH, on the records' slot.
def _write_script(sharded: bool) -> lua.Script:
    return lua.Script("write_results", sharded=sharded, GROUP=CONSUMER_GROUP,
                      TERMINAL=" or ".join(f"state == '{state}'" for state in TERMINAL_STATES))


_CLAIM_SCRIPT = lua.Script("claim")
GAP = 2  # the write script's answer for an update whose record lost the writes before it


def _wire(value: object) -> str | bytes:
    """A hash value as Redis stores it (numbers as their exact decimal text, not Lua's)."""
    return value if isinstance(value, (str, bytes)) else str(value)


@dataclass
class ResultUpdate:
    req_id: str
    stream: str
    fields: dict[str, object]  # hash fields to set (values: str, int, float or bytes)
    event: bytes | None = None  # published on tf:ev:{id} when given
    ack_entry_id: str | None = None  # acknowledged (and deleted) with a terminal state
    batch_job_id: str | None = None  # a batch item's terminal write notifies the ingesters
    # Appended to what the field holds (text deltas, list chunks), once per seq: fields["seq"]
    # must be given with them.
    appends: dict[str, str | bytes] = field(default_factory=dict)


class ResultStore:
    """On a cluster, each call touches one partition's keys: a step's writes and an admission's
    claims go as one script call per partition, all in one pipeline (split by node)."""

    def __init__(self, client: redis.Redis, keys: Keys, owner: str, ttl_s: int) -> None:
        self.client = client
        self.keys = keys
        self.owner = owner
        self.ttl_s = ttl_s
        self.is_cluster = is_cluster_client(client)
        self._write = _write_script(sharded=self.is_cluster)

    def write(self, updates: list[ResultUpdate]) -> list[bool]:
        """One round trip and one script call per partition; False where another scheduler
        owns the request."""
        owned, _ = self.write_packed([self.pack(update) for update in updates])
        return owned

    def pack(self, update: ResultUpdate) -> tuple[int, str, str, str, list]:
        """One update as the write script reads it (protocol/lua/write_results.lua): (its
        partition, its record, its stream, its req id, the script's u)."""
        is_notice = update.batch_job_id is not None and is_terminal_write(update.fields)
        appends: list[str | bytes] = []
        for name, value in update.appends.items():
            appends += (name, _wire(value))
        sets: list[str | bytes] = []
        for name, value in update.fields.items():
            sets += (name, _wire(value))
        u = [self.keys.events(update.req_id) if update.event is not None else "", update.event or b"",
             update.ack_entry_id or "", 1 if is_notice else 0,
             update.req_id if is_notice else "", update.batch_job_id if is_notice else "",
             _wire(update.fields.get(F.SEQ, "")) if update.appends else "", appends, sets]
        return (self.keys.partition(update.req_id), self.keys.result(update.req_id), update.stream,
                update.req_id, u)

    def write_packed(self, packed: list[tuple]) -> tuple[list[bool], list[int]]:
        """Write updates made by pack(), in order within each request, in one script call per
        partition; then end the tenant leases of the requests whose entries it acknowledged.
        Returns whether this scheduler owns each request, and the indexes of the updates that
        found a gap in their record (nothing of them written: the writer sends whole records)."""
        if not packed:
            return [], []
        groups: dict[int, list[int]] = {}
        for i, (partition, *_) in enumerate(packed):
            groups.setdefault(partition, []).append(i)
        calls = []
        for partition, members in groups.items():
            keys: list[str] = []
            for i in members:
                keys += packed[i][1:3]
            if any(packed[i][4][3] for i in members):
                keys.append(self.keys.batch_done_of(partition))
            # Redis' Lua msgpack (cmsgpack) predates the bin type: every string goes as raw bytes.
            updates = msgpack.packb([packed[i][4] for i in members], use_bin_type=False)
            calls.append((keys, [self.owner, self.ttl_s, updates]))
        owned: list[bool] = [False] * len(packed)
        gaps: list[int] = []
        ended: list[tuple[bytes, str]] = []  # (tenant, req id) of the leases that end
        for members, reply in zip(groups.values(), self._write.run_many(self.client, calls), strict=True):
            for i, flag in zip(members, reply, strict=True):
                owned[i] = flag != 0
                if flag == GAP:
                    gaps.append(i)
                elif isinstance(flag, bytes):
                    ended.append((flag, packed[i][3]))
        if self.is_cluster:
            self._confirm_replicated([packed[members[0]][1] for members in groups.values()])
        if ended:
            pipe = self.client.pipeline(transaction=False)
            for tenant, req_id in ended:
                pipe.zrem(self.keys.tenant_leases(tenant.decode()), req_id)
            pipe.execute()
        return owned, sorted(gaps)

    def _confirm_replicated(self, record_keys: list[str]) -> None:
        """On a cluster, a write counts once a replica has it: else ConnectionError, and the
        writer sends the same updates again (to the promoted replica, after a failover), so the
        record never misses a step its clients saw (appends are skipped where they landed)."""
        nodes = {node.name: node for node in map(self.client.get_node_from_key, record_keys)}
        late = unreplicated(self.client, list(nodes.values()))
        if late:
            raise redis.ConnectionError(f"no replica of the Redis shard(s) {', '.join(late)} confirmed "
                                        f"the step's writes")

    def claim(self, req_id: str) -> StoredProgress:
        """Become the owner of a request and read what was delivered before."""
        return self.claim_many([req_id], [])[0][0]

    def claim_many(self, req_ids: list[str], flag_keys: list[str]) -> tuple[list[StoredProgress], list[bool]]:
        """claim() for each request, and whether each of flag_keys exists, atomically per
        partition, in one round trip for all (admitting a burst of requests costs one, not two
        per request). A flag key names a request's partition as its record does."""
        by_partition: dict[int, tuple[list[int], list[int]]] = {}
        for i, req_id in enumerate(req_ids):
            by_partition.setdefault(self.keys.partition(req_id), ([], []))[0].append(i)
        for j, key in enumerate(flag_keys):
            by_partition.setdefault(self.keys.partition_of_key(key), ([], []))[1].append(j)
        calls = [([*(self.keys.result(req_ids[i]) for i in records), *(flag_keys[j] for j in flags)],
                  [self.owner, self.ttl_s, len(records)]) for records, flags in by_partition.values()]
        progress: list[StoredProgress | None] = [None] * len(req_ids)
        exists = [False] * len(flag_keys)
        for (records, flags), reply in zip(by_partition.values(), _CLAIM_SCRIPT.run_many(self.client, calls),
                                           strict=True):
            for i, flat in zip(records, reply[:len(records)], strict=True):
                progress[i] = StoredProgress.parse(dict(zip(flat[::2], flat[1::2], strict=True)))
            for j, flag in zip(flags, reply[len(records):], strict=True):
                exists[j] = bool(flag)
        return progress, exists  # type: ignore[return-value]
