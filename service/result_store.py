"""The one atomic write that updates each request's `tf:res:{id}` record (protocol/result_record.py).

Each step, one Lua call takes every request that moved and, for each, checks that this
scheduler still owns the request, mirrors the new state into the hash, publishes the event
on `tf:ev:{id}` and, for a terminal state, acknowledges the stream entry.
Ownership fencing is what makes takeover safe: once a successor has claimed
a request, a slow predecessor's writes are refused instead of interleaving.

A batch item's terminal write also appends a notice to `tf:batch:done`, in the same call and
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

# The step's write (its keys and arguments are named in the script's header).
_WRITE_SCRIPT = lua.load("write_results", GROUP=CONSUMER_GROUP,
                         TERMINAL=" or ".join(f"state == '{state}'" for state in TERMINAL_STATES))


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
    def __init__(self, client: redis.Redis, keys: Keys, owner: str, ttl_s: int) -> None:
        self.client = client
        self.keys = keys
        self.owner = owner
        self.ttl_s = ttl_s
        self._write = client.register_script(_WRITE_SCRIPT)
        before, after = keys.tenant_leases("\0").split("\0")
        self._lease_key_parts = (before, after, keys.result(""))

    def write(self, updates: list[ResultUpdate]) -> list[bool]:
        """One round trip and one script call for all updates; False where another scheduler
        owns the request."""
        return self.write_packed([self.pack(update) for update in updates])

    def pack(self, update: ResultUpdate) -> list:
        """One update as the write script reads it (protocol/lua/write_results.lua)."""
        is_notice = update.batch_job_id is not None and is_terminal_write(update.fields)
        appends: list[str | bytes] = []
        for name, value in update.appends.items():
            appends += (name, _wire(value))
        sets: list[str | bytes] = []
        for name, value in update.fields.items():
            sets += (name, _wire(value))
        return [
            self.keys.result(update.req_id), update.stream,
            self.keys.events(update.req_id) if update.event is not None else "", update.event or b"",
            update.ack_entry_id or "",
            self.keys.batch_done if is_notice else "", update.req_id if is_notice else "",
            update.batch_job_id if is_notice else "",
            _wire(update.fields.get(F.SEQ, "")) if update.appends else "", appends, sets,
        ]

    def write_packed(self, packed: list[list]) -> list[bool]:
        """Write updates made by pack(), in order, in one script call."""
        if not packed:
            return []
        # Redis' Lua msgpack (cmsgpack) predates the bin type: every string goes as raw bytes.
        owned = self._write(args=[self.owner, self.ttl_s, msgpack.packb(packed, use_bin_type=False),
                                  *self._lease_key_parts])
        return [bool(flag) for flag in owned]

    def claim(self, req_id: str) -> StoredProgress:
        """Become the owner of a request and read what was delivered before."""
        return self.claim_many([req_id], [])[0][0]

    def claim_many(self, req_ids: list[str], flag_keys: list[str]) -> tuple[list[StoredProgress], list[bool]]:
        """claim() for each request, and whether each of flag_keys exists, in one atomic round
        trip (admitting a burst of requests costs one, not two per request)."""
        pipe = self.client.pipeline(transaction=True)
        for req_id in req_ids:
            key = self.keys.result(req_id)
            pipe.hgetall(key)
            pipe.hset(key, F.OWNER, self.owner)
            pipe.expire(key, self.ttl_s)
        for key in flag_keys:
            pipe.exists(key)
        replies = pipe.execute() if req_ids or flag_keys else []
        progress = [StoredProgress.parse(raw) for raw in replies[0:3 * len(req_ids):3]]
        return progress, [bool(n) for n in replies[3 * len(req_ids):]]
