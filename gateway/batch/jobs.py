"""A batch job's state in Redis, and the atomic steps that move it.

`tf:batch:{job}` (hash) holds the job: status, counts, timestamps, model, endpoint...
Its lines wait in `tf:batch:{job}:lines` (a list, consumed from the head) until they are
queued; each result is appended to `tf:batch:{job}:out` (a stream) exactly once, which the
bitmap `tf:batch:{job}:written` enforces: a line's bit is set in the same Lua call that
appends its output, so a step retried after a crash, or done twice by two ingesters, writes
nothing twice. Queueing is a compare-and-set on `next_index`, so two ingesters never queue
one line twice either, and the number of queued-but-unwritten lines never passes the
in-flight bound.

Status: validating -> in_progress -> finalizing -> completed; failed (intake refused the
job); cancelling -> cancelled; expired (past its completion window). Every line is
accounted for in the counts: completed + failed == total when the job ends, whatever way.

The scripts touch the records of the requests they queue (tf:res:{id}) without declaring
them in KEYS: fine on one Redis server, which is what tokenfleet runs on.
"""

from __future__ import annotations

import json
import re
import time
import uuid

import numpy as np
import redis.asyncio as aioredis

from gateway.batch.record import JOB_STATES as JOB_STATES  # (re-exported: where callers look for them)
from gateway.batch.record import TERMINAL_JOB_STATES as TERMINAL_JOB_STATES
from gateway.batch.record import Job
from protocol.keys import INGESTER_GROUP, JOB_ID_PATTERN, Keys

# Shared by the scripts that write outputs: when every line is written, the job is finalizing.
_FINISH_CHECK = """
local h = redis.call('HMGET', KEYS[1], 'total', 'next_index', 'completed', 'failed', 'status')
local total = tonumber(h[1] or '-1')
if total >= 0 and tonumber(h[2] or '0') >= total
   and tonumber(h[3] or '0') + tonumber(h[4] or '0') >= total
   and (h[5] == 'in_progress' or h[5] == 'cancelling') then
  redis.call('HSET', KEYS[1], 'status', 'finalizing', 'finalizing_at', ARGV[3])
  return 2
end
"""

# Queue the next lines of a job, or write them off as error lines.
# KEYS: job, lines, request stream, out, written.
# ARGV: expected next_index, number of lines consumed, now, record ttl, 'run' | 'end',
#       then items: 'E', index, custom_id, output line  |  'R', record key, message, n, n field/value pairs.
_FEED_SCRIPT = """
local status = redis.call('HGET', KEYS[1], 'status')
local ending = redis.call('HGET', KEYS[1], 'ending')
if ARGV[5] == 'run' and (status ~= 'in_progress' or ending) then return -1 end
if ARGV[5] == 'end' and not ending then return -1 end
if tonumber(redis.call('HGET', KEYS[1], 'next_index') or '0') ~= tonumber(ARGV[1]) then return -2 end
local failed = 0
local i = 6
while i <= #ARGV do
  if ARGV[i] == 'E' then
    if redis.call('SETBIT', KEYS[5], ARGV[i + 1], 1) == 0 then
      redis.call('XADD', KEYS[4], '*', 'index', ARGV[i + 1], 'custom_id', ARGV[i + 2], 'ok', '0',
                 'line', ARGV[i + 3])
      failed = failed + 1
    end
    i = i + 4
  else
    local key, n = ARGV[i + 1], tonumber(ARGV[i + 3])
    redis.call('HSET', key, unpack(ARGV, i + 4, i + 3 + 2 * n))
    local entry = redis.call('XADD', KEYS[3], '*', 'm', ARGV[i + 2])
    redis.call('HSET', key, 'entry_id', entry)
    redis.call('EXPIRE', key, tonumber(ARGV[4]))
    i = i + 4 + 2 * n
  end
end
redis.call('LTRIM', KEYS[2], tonumber(ARGV[2]), -1)
redis.call('HINCRBY', KEYS[1], 'next_index', tonumber(ARGV[2]))
if failed > 0 then redis.call('HINCRBY', KEYS[1], 'failed', failed) end
""" + _FINISH_CHECK + """
return 1
"""

# Write one line's output, once. KEYS: job, out, written, then the line's request records
# (deleted: the output holds what they held).  ARGV: index, custom_id, now, ok ('1'/'0'), line.
_COLLECT_SCRIPT = """
if redis.call('SETBIT', KEYS[3], ARGV[1], 1) == 1 then return 0 end
redis.call('XADD', KEYS[2], '*', 'index', ARGV[1], 'custom_id', ARGV[2], 'ok', ARGV[4], 'line', ARGV[5])
redis.call('HINCRBY', KEYS[1], ARGV[4] == '1' and 'completed' or 'failed', 1)
for k = 4, #KEYS do redis.call('DEL', KEYS[k]) end
""" + _FINISH_CHECK + """
return 1
"""

# An intake's lines go to the job's staging list, fenced by the intake's token: an intake that
# another ingester took over (its claim lapsed) finds its token replaced and stops, so two intakes
# never interleave their lines. KEYS: job, staging.  ARGV: token, '1' to start the list over,
# then the packed lines. Returns -1 when the intake is no longer this token's.
_STAGE_SCRIPT = """
if redis.call('HGET', KEYS[1], 'intake_token') ~= ARGV[1] then return -1 end
if ARGV[2] == '1' then redis.call('DEL', KEYS[2]) end
if #ARGV > 2 then return redis.call('RPUSH', KEYS[2], unpack(ARGV, 3)) end
return 0
"""

# Intake is done: the staged lines become the job's, the job starts, the entry leaves tf:batch:in.
# KEYS: job, staging, lines, tf:batch:in, active set.
# ARGV: entry id, total, now, job id, expires_at, intake token ('' when committed already).
_COMMIT_SCRIPT = """
if redis.call('HGET', KEYS[1], 'committed') then
  redis.call('XACK', KEYS[4], '""" + INGESTER_GROUP + """', ARGV[1])
  redis.call('XDEL', KEYS[4], ARGV[1])
  return 0
end
if redis.call('HGET', KEYS[1], 'intake_token') ~= ARGV[6] then return -1 end
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('RENAME', KEYS[2], KEYS[3]) end
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'validating' then status = 'in_progress' end
redis.call('HSET', KEYS[1], 'committed', 1, 'status', status, 'total', ARGV[2], 'next_index', 0,
           'completed', 0, 'failed', 0, 'in_progress_at', ARGV[3], 'expires_at', ARGV[5])
redis.call('SADD', KEYS[5], ARGV[4])
redis.call('XACK', KEYS[4], '""" + INGESTER_GROUP + """', ARGV[1])
redis.call('XDEL', KEYS[4], ARGV[1])
return 1
"""

# A job that intake refused. KEYS: job, tf:batch:in.  ARGV: entry id, now, errors json.
_REFUSE_SCRIPT = """
redis.call('HSET', KEYS[1], 'status', 'failed', 'failed_at', ARGV[2], 'errors', ARGV[3], 'committed', 1,
           'total', 0, 'completed', 0, 'failed', 0)
redis.call('XACK', KEYS[2], '""" + INGESTER_GROUP + """', ARGV[1])
redis.call('XDEL', KEYS[2], ARGV[1])
return 1
"""

# An entry's intake starts: the job's record in validating unless it exists, in one step (so no
# reader ever sees half a record). KEYS: job, jobs zset, entry -> job.  ARGV: job id, now, entry id,
# intake token, then the entry's described field/value pairs. Returns 0 when the job existed.
_BEGIN_SCRIPT = """
if redis.call('HSETNX', KEYS[1], 'id', ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'status', 'validating', 'created_at', ARGV[2], 'entry_id', ARGV[3],
           'intake_token', ARGV[4], unpack(ARGV, 5))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('SET', KEYS[3], ARGV[1])
return 1
"""

# A job submitted through the gateway or the CLI: its entry in tf:batch:in and its record in
# validating, atomically, so it can be read back at once.  KEYS: tf:batch:in, job, jobs zset.
# ARGV: job id, now, then the entry's field/value pairs. Returns false when the id is taken.
_CREATE_SCRIPT = """
if redis.call('EXISTS', KEYS[2]) == 1 then return false end
local entry = redis.call('XADD', KEYS[1], '*', 'job_id', ARGV[1], unpack(ARGV, 3))
redis.call('HSET', KEYS[2], 'id', ARGV[1], 'status', 'validating', 'created_at', ARGV[2], 'entry_id', entry)
for i = 3, #ARGV, 2 do
  if ARGV[i] ~= 'lines' then redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
end
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
return entry
"""

# Stop a job: ARGV[1] is 'cancelled' (a client asked) or 'expired'; ARGV[2] now.  KEYS: job.
_STOP_SCRIPT = """
local status = redis.call('HGET', KEYS[1], 'status')
if redis.call('HGET', KEYS[1], 'ending') then return 0 end
if status ~= 'validating' and status ~= 'in_progress' then return 0 end
redis.call('HSET', KEYS[1], 'ending', ARGV[1])
if ARGV[1] == 'cancelled' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[2])
end
return 1
"""

# The last step: the end state, and the job's working keys go.  KEYS: job, lines, written, active.
# ARGV: job id, now.
_FINALIZE_SCRIPT = """
if redis.call('HGET', KEYS[1], 'status') ~= 'finalizing' then return 0 end
local final = redis.call('HGET', KEYS[1], 'ending') or 'completed'
redis.call('HSET', KEYS[1], 'status', final, final .. '_at', ARGV[2])
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('SREM', KEYS[4], ARGV[1])
return 1
"""


class IntakeLost(Exception):
    """Another ingester took this intake over (this one's claim on the entry lapsed)."""


def new_job_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def item_req_id(job_id: str, index: int, choice: int) -> str:
    """A batch item's request id: made from server-checked parts, so safe inside keys."""
    return f"{job_id}.{index}.{choice}"


def parse_item_req_id(req_id: str) -> tuple[str, int, int]:
    job_id, index, choice = req_id.rsplit(".", 2)
    return job_id, int(index), int(choice)


class JobStore:
    """The Redis side of batch jobs, for the ingester, the HTTP routes and the CLI alike."""

    def __init__(self, client: aioredis.Redis, keys: Keys, *, record_ttl_s: int = 24 * 3600) -> None:
        self.client = client
        self.keys = keys
        self.record_ttl_s = record_ttl_s
        self._feed = client.register_script(_FEED_SCRIPT)
        self._collect = client.register_script(_COLLECT_SCRIPT)
        self._stage = client.register_script(_STAGE_SCRIPT)
        self._commit = client.register_script(_COMMIT_SCRIPT)
        self._refuse = client.register_script(_REFUSE_SCRIPT)
        self._stop = client.register_script(_STOP_SCRIPT)
        self._finalize = client.register_script(_FINALIZE_SCRIPT)
        self._create = client.register_script(_CREATE_SCRIPT)
        self._begin = client.register_script(_BEGIN_SCRIPT)

    # -- reading ----------------------------------------------------------------------

    async def get(self, job_id: str) -> Job | None:
        return Job.parse(job_id, await self.client.hgetall(self.keys.batch_job(job_id)))

    async def list(self, *, limit: int, after: str | None = None) -> tuple[list[Job], bool]:
        """Newest first; `after` is the id of the last job of the previous page."""
        start = 0
        if after is not None:
            rank = await self.client.zrevrank(self.keys.batch_jobs, after)
            start = 0 if rank is None else rank + 1
        ids = await self.client.zrevrange(self.keys.batch_jobs, start, start + limit)
        has_more = len(ids) > limit
        ids = ids[:limit]
        if not ids:
            return [], has_more
        # Keys built from the raw member, so that a member that is not text still finds its record
        # (and shows as corrupt) instead of failing the listing.
        key_prefix = self.keys.batch_job("").encode()
        pipe = self.client.pipeline(transaction=False)
        for raw_id in ids:
            pipe.hgetall(key_prefix + raw_id)
        jobs = []
        for raw_id, raw in zip(ids, await pipe.execute(), strict=True):
            job = Job.parse(raw_id.decode(errors="replace"), raw)
            if job is not None:  # (a record deleted by hand: nothing to show)
                jobs.append(job)
        return jobs, has_more

    async def outputs(self, job_id: str, *, ok: bool | None = None) -> list[str]:
        """The job's output lines in the order they were written (ok: only those / only not)."""
        lines = []
        last = "-"
        while True:
            entries = await self.client.xrange(self.keys.batch_out(job_id), min=last, count=1000)
            if last != "-":
                entries = entries[1:]
            if not entries:
                return lines
            for _, fields in entries:
                if ok is None or (fields[b"ok"] == b"1") == ok:
                    lines.append(fields[b"line"].decode())
            last = entries[-1][0].decode()

    # -- intake -----------------------------------------------------------------------

    async def create(self, job_id: str, entry_fields: dict[str, object]) -> str:
        """Submit a job (what a plain Redis client does with one XADD), readable at once; returns
        its entry id. ValueError when job_id is not a usable id or another job has it."""
        if not re.match(JOB_ID_PATTERN, job_id):
            raise ValueError(f"job id {job_id[:80]!r} must match {JOB_ID_PATTERN}")
        args: list[object] = [job_id, time.time()]
        for name, value in entry_fields.items():
            args += [name, value]
        keys = [self.keys.batch_in, self.keys.batch_job(job_id), self.keys.batch_jobs]
        entry = await self._create(keys=keys, args=args)
        if entry is None:
            raise ValueError(f"job id {job_id!r} is taken by another job")
        return entry.decode() if isinstance(entry, bytes) else str(entry)

    async def begin(self, job_id: str, entry_id: str, fields: dict[str, object],
                    token: str = "") -> Job | None:
        """Create the job in `validating` unless it exists; the existing job otherwise. Either
        way the intake is now `token`'s: an earlier intake of the same entry stages no more."""
        key = self.keys.batch_job(job_id)
        args: list[object] = [job_id, time.time(), entry_id, token]
        for name, value in fields.items():
            args += [name, value]
        if await self._begin(keys=[key, self.keys.batch_jobs, self.keys.batch_entry(entry_id)], args=args):
            return None
        job = await self.get(job_id)
        if job is not None and not job.fields.get("committed") and job.fields.get("entry_id") == entry_id:
            await self.client.hset(key, "intake_token", token)
        return job

    async def stage(self, job_id: str, packed_items: list[bytes], token: str = "", chunk: int = 1000) -> None:
        """The job's lines, staged by the intake holding `token` (IntakeLost once another has it)."""
        keys = [self.keys.batch_job(job_id), self.keys.batch_staging(job_id)]
        starts = range(0, len(packed_items), chunk) or [0]
        for start in starts:  # the first call starts the list over: a retried intake redoes it all
            items = packed_items[start:start + chunk]
            if int(await self._stage(keys=keys, args=[token, "1" if start == 0 else "0", *items])) < 0:
                raise IntakeLost(job_id)

    async def commit(self, job_id: str, entry_id: str, total: int, expires_at: float,
                     token: str = "") -> bool:
        """True when this call committed the job; False when it was committed before (the entry is
        acknowledged either way). IntakeLost when another intake holds the job now."""
        keys = [self.keys.batch_job(job_id), self.keys.batch_staging(job_id), self.keys.batch_lines(job_id),
                self.keys.batch_in, self.keys.batch_active]
        result = int(await self._commit(keys=keys, args=[entry_id, total, time.time(), job_id, expires_at,
                                                         token]))
        if result < 0:
            raise IntakeLost(job_id)
        return bool(result)

    async def refuse(self, job_id: str, entry_id: str, errors: list[dict]) -> None:
        await self._refuse(keys=[self.keys.batch_job(job_id), self.keys.batch_in],
                           args=[entry_id, time.time(), json.dumps(errors)])

    # -- running ----------------------------------------------------------------------

    async def head_lines(self, job_id: str, count: int) -> list[bytes]:
        return await self.client.lrange(self.keys.batch_lines(job_id), 0, count - 1)

    async def feed(self, job: Job, model: str, num_lines: int, items: list[object], *, mode: str) -> int:
        """Queue/write off the next num_lines lines (items: the script's flat item list):
        1 done, 2 done and the job's last line is written, -1 the job is not in that state,
        -2 another ingester moved first."""
        keys = [self.keys.batch_job(job.id), self.keys.batch_lines(job.id),
                self.keys.request_stream(model, "batch", job.tenant), self.keys.batch_out(job.id),
                self.keys.batch_written(job.id)]
        if job.tenant is not None and mode == "run":  # the schedulers read the tenant's stream from now on
            await self.client.sadd(self.keys.tenants(model), job.tenant)
        args = [job.next_index, num_lines, time.time(), self.record_ttl_s, mode, *items]
        return int(await self._feed(keys=keys, args=args))

    async def collect(self, job_id: str, index: int, custom_id: str | None, ok: bool, line: str,
                      record_keys: list[str]) -> int:
        """1 written, 0 written before, 2 written and it was the job's last line."""
        keys = [self.keys.batch_job(job_id), self.keys.batch_out(job_id), self.keys.batch_written(job_id),
                *record_keys]
        return int(await self._collect(keys=keys, args=[index, custom_id or "", time.time(),
                                                        "1" if ok else "0", line]))

    async def written_bits(self, job_id: str) -> bytes:
        return await self.client.get(self.keys.batch_written(job_id)) or b""

    async def stop(self, job_id: str, ending: str) -> bool:
        return bool(await self._stop(keys=[self.keys.batch_job(job_id)], args=[ending, time.time()]))

    async def finalize(self, job_id: str) -> bool:
        keys = [self.keys.batch_job(job_id), self.keys.batch_lines(job_id), self.keys.batch_written(job_id),
                self.keys.batch_active]
        return bool(await self._finalize(keys=keys, args=[job_id, time.time()]))

    async def active(self) -> list[str]:
        return sorted(m.decode() for m in await self.client.smembers(self.keys.batch_active))

    async def tenant_lines_in_flight(self, tenant: str) -> int:
        """Lines queued and not yet written, over all of the tenant's active jobs."""
        job_ids = await self.active()
        pipe = self.client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(self.keys.batch_job(job_id), ["tenant", "next_index", "completed", "failed"])
        total = 0
        for owner, next_index, completed, failed in await pipe.execute():
            if owner is not None and owner.decode() == tenant:
                total += int(next_index or 0) - int(completed or 0) - int(failed or 0)
        return total


def unwritten(bits: bytes, count: int) -> list[int]:
    """The indexes below `count` whose bit is not set (Redis counts bits from the most
    significant end of each byte); numpy, since a job may have a million lines."""
    flags = np.unpackbits(np.frombuffer(bits, dtype=np.uint8))[:count]
    missing = np.flatnonzero(flags == 0).tolist()
    return missing + list(range(len(flags), count))  # past the bitmap's end: not set either
