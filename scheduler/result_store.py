"""The `tf:res:{id}` record of each request, and the one atomic write that updates it.

Each step, for each request that moved, one Lua call (all of them pipelined into one
round trip) checks that this scheduler still owns the request, mirrors the new state into
the hash, publishes the event on `tf:ev:{id}` and, for a terminal state, acknowledges the
stream entry. Ownership fencing is what makes takeover safe: once a successor has claimed
a request, a slow predecessor's writes are refused instead of interleaving.

A batch item's terminal write also appends a notice to `tf:batch:done`, in the same call and
only on the first terminal write, so the batch ingesters learn of every finished item exactly
when (and as surely as) its result exists.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis

from shared.keys import CONSUMER_GROUP, Keys
from shared.messages import TERMINAL_STATES, unpack_list_chunks

# KEYS: result hash, request stream, [batch notice stream].  ARGV: owner, channel ('' = none),
# event, ttl, entry id to acknowledge ('' = none), notice req id ('' = none), notice job id,
# number of appended fields n, seq of this update ('' = none), n field/chunk pairs to append,
# then field/value pairs to set. The appends are skipped when the record's seq has reached
# this update's: a flush retried after a lost connection must not append a chunk twice.
_WRITE_SCRIPT = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= ARGV[1] then return 0 end
local notify = false
if ARGV[6] ~= '' then
  local state = redis.call('HGET', KEYS[1], 'state')
  notify = not (state == 'completed' or state == 'failed' or state == 'cancelled' or state == 'expired')
end
local n = tonumber(ARGV[8])
local first_set = 10 + 2 * n
local applied = ARGV[9] ~= '' and tonumber(redis.call('HGET', KEYS[1], 'seq') or '0') >= tonumber(ARGV[9])
if n > 0 and not applied then
  for i = 10, first_set - 1, 2 do
    redis.call('HSET', KEYS[1], ARGV[i], (redis.call('HGET', KEYS[1], ARGV[i]) or '') .. ARGV[i + 1])
  end
end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], unpack(ARGV, first_set))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
if ARGV[2] ~= '' then redis.call('PUBLISH', ARGV[2], ARGV[3]) end
if ARGV[5] ~= '' then
  redis.call('XACK', KEYS[2], 'GROUP', ARGV[5])
  redis.call('XDEL', KEYS[2], ARGV[5])
end
if notify then redis.call('XADD', KEYS[3], '*', 'req', ARGV[6], 'job', ARGV[7]) end
return 1
""".replace("'GROUP'", f"'{CONSUMER_GROUP}'")


@dataclass
class StoredProgress:
    """What a previous owner already delivered: where a successor resumes."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    seq: int = 0
    offsets: list = field(default_factory=list)  # per event: [num_tokens, num_chars] so far
    state: str | None = None
    owner: str | None = None


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

    def write(self, updates: list[ResultUpdate]) -> list[bool]:
        """One round trip for all updates; False where another scheduler owns the request."""
        if not updates:
            return []
        pipe = self.client.pipeline(transaction=False)
        for update in updates:
            args: list[object] = [
                self.owner,
                self.keys.events(update.req_id) if update.event is not None else "",
                update.event or b"",
                self.ttl_s,
                update.ack_entry_id or "",
            ]
            keys = [self.keys.result(update.req_id), update.stream]
            if update.batch_job_id is not None and update.fields.get("state") in TERMINAL_STATES:
                args += [update.req_id, update.batch_job_id]
                keys.append(self.keys.batch_done)
            else:
                args += ["", ""]
            args += [len(update.appends), update.fields.get("seq", "") if update.appends else ""]
            for name, value in update.appends.items():
                args += [name, value]
            for name, value in update.fields.items():
                args += [name, value]
            self._write(keys=keys, args=args, client=pipe)
        return [bool(ok) for ok in pipe.execute()]

    def claim(self, req_id: str) -> StoredProgress:
        """Become the owner of a request and read what was delivered before."""
        key = self.keys.result(req_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.hgetall(key)
        pipe.hset(key, "owner", self.owner)
        pipe.expire(key, self.ttl_s)
        raw, _, _ = pipe.execute()
        progress = StoredProgress()
        if raw:
            fields = {k.decode(): v for k, v in raw.items()}
            if b"token_ids" in raw:
                progress.token_ids = unpack_list_chunks(raw[b"token_ids"])
            progress.text = fields.get("text", b"").decode()
            if b"offsets" in raw:
                progress.offsets = unpack_list_chunks(raw[b"offsets"])
            progress.seq = int(fields.get("seq", b"0"))
            progress.state = fields["state"].decode() if "state" in fields else None
            progress.owner = fields["owner"].decode() if "owner" in fields else None
        return progress


def terminal_fields(state: str, *, error_code: str | None = None, error_message: str | None = None,
                    **extra: object) -> dict[str, object]:
    fields: dict[str, object] = {"state": state, "finished_at": time.time(), **extra}
    if error_code is not None:
        fields["error"] = json.dumps({"code": error_code, "message": error_message})
    return fields
