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

The scripts (protocol/lua/batch_*.lua) name every key they touch in KEYS, the records of the
requests they queue too, and touch one slot each: a job's keys, its items (ids `<job>.<line>.
<choice>`) and the request stream it feeds share the job's partition tag (protocol/keys.py).
The fleet's shared keys (tf:batch:in, the jobs zset, the active set) are written by idempotent
commands around the scripts, so a job works alike on one server and on a Redis Cluster.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass

import numpy as np
import redis.asyncio as aioredis
from aiohttp import web

from gateway.api.batch.record import JOB_STATES as JOB_STATES  # (re-exported: where callers look for them)
from gateway.api.batch.record import TERMINAL_JOB_STATES as TERMINAL_JOB_STATES
from gateway.api.batch.record import Job
from protocol import lua
from protocol.keys import INGESTER_GROUP, JOB_ID_PATTERN, Keys

# The scripts that move a job (protocol/lua/batch_*.lua, their KEYS and ARGV named in each one's
# header); those that write outputs end with the check that moves a finished job to finalizing.
_FINISH_CHECK = lua.load("batch_finish_check")
_FEED = lua.Script("batch_feed", FINISH_CHECK=_FINISH_CHECK)
_COLLECT = lua.Script("batch_collect", FINISH_CHECK=_FINISH_CHECK)
COLLECT_CHUNK = 64  # lines written per batch_collect call (a decoder's vector is 22 KiB of base64)
_STAGE = lua.Script("batch_stage")
_COMMIT = lua.Script("batch_commit")
_REFUSE = lua.Script("batch_refuse")
_BEGIN = lua.Script("batch_begin")
_CREATE = lua.Script("batch_create")
_STOP = lua.Script("batch_stop")
_FINALIZE = lua.Script("batch_finalize")


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


@dataclass
class LineOutput:
    """A line's output line, ready to be written, and the request records it replaces."""
    index: int
    custom_id: str | None
    ok: bool
    line: str
    record_keys: list[str]


class JobStore:
    """The Redis side of batch jobs, for the ingester, the HTTP routes and the CLI alike."""

    def __init__(self, client: aioredis.Redis, keys: Keys, *, record_ttl_s: int = 24 * 3600) -> None:
        self.client = client
        self.keys = keys
        self.record_ttl_s = record_ttl_s

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
        pipe = self.client.pipeline(transaction=False)
        for raw_id in ids:
            pipe.hgetall(self.keys.batch_job_raw(raw_id))
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
        its entry id. ValueError when job_id is not a usable id or another job has it. The entry
        goes first, then the record (in the job's slot; an intake that read the entry meanwhile
        made it already, from the same entry), then the listing: a crash in between leaves an
        entry that intake turns into the job all the same."""
        if not re.match(JOB_ID_PATTERN, job_id):
            raise ValueError(f"job id {job_id[:80]!r} must match {JOB_ID_PATTERN}")
        key = self.keys.batch_job(job_id)
        if await self.client.exists(key):
            raise ValueError(f"job id {job_id!r} is taken by another job")
        now = time.time()
        entry = (await self.client.xadd(self.keys.batch_in, {"job_id": job_id, **entry_fields})).decode()
        args: list[object] = [job_id, now, entry]
        for name, value in entry_fields.items():
            args += [name, value]
        if not int(await _CREATE.run_async(self.client, [key], args)):
            await self.client.xdel(self.keys.batch_in, entry)  # (another submit took the id meanwhile)
            raise ValueError(f"job id {job_id!r} is taken by another job")
        await self.client.zadd(self.keys.batch_jobs, {job_id: now}, nx=True)
        return entry

    async def begin(self, job_id: str, entry_id: str, fields: dict[str, object],
                    token: str = "") -> Job | None:
        """Create the job in `validating` unless it exists; the existing job otherwise. Either
        way the intake is now `token`'s: an earlier intake of the same entry stages no more.
        The job is listed, and its entry mapped to it, whenever the job is this entry's (again
        after a crash: both are idempotent)."""
        key = self.keys.batch_job(job_id)
        now = time.time()
        args: list[object] = [job_id, now, entry_id, token]
        for name, value in fields.items():
            args += [name, value]
        made = int(await _BEGIN.run_async(self.client, [key], args))
        job = None if made else await self.get(job_id)
        if made or (job is not None and job.fields.get("entry_id") == entry_id):
            pipe = self.client.pipeline(transaction=False)
            pipe.zadd(self.keys.batch_jobs, {job_id: now}, nx=True)
            pipe.set(self.keys.batch_entry(entry_id), job_id)
            await pipe.execute()
        if made:
            return None
        if job is not None and not job.fields.get("committed") and job.fields.get("entry_id") == entry_id:
            await self.client.hset(key, "intake_token", token)
        return job

    async def stage(self, job_id: str, packed_items: list[bytes], token: str = "", chunk: int = 1000) -> None:
        """The job's lines, staged by the intake holding `token` (IntakeLost once another has it)."""
        keys = [self.keys.batch_job(job_id), self.keys.batch_staging(job_id)]
        starts = range(0, len(packed_items), chunk) or [0]
        for start in starts:  # the first call starts the list over: a retried intake redoes it all
            items = packed_items[start:start + chunk]
            args = [token, "1" if start == 0 else "0", *items]
            if int(await _STAGE.run_async(self.client, keys, args)) < 0:
                raise IntakeLost(job_id)

    async def commit(self, job_id: str, entry_id: str, total: int, expires_at: float,
                     token: str = "") -> bool:
        """True when this call committed the job; False when it was committed before (the entry is
        acknowledged either way). IntakeLost when another intake holds the job now. A running job
        is listed as active after the commit, then its entry acknowledged: a crash in between
        leaves the entry pending, and its next intake does both again."""
        keys = [self.keys.batch_job(job_id), self.keys.batch_staging(job_id), self.keys.batch_lines(job_id)]
        result = int(await _COMMIT.run_async(self.client, keys, [total, time.time(), expires_at, token]))
        if result < 0:
            raise IntakeLost(job_id)
        if result in (0, 1):
            await self.client.sadd(self.keys.batch_active, job_id)
        await self._acknowledge_intake(entry_id)
        return result == 1

    async def refuse(self, job_id: str, entry_id: str, errors: list[dict]) -> None:
        await _REFUSE.run_async(self.client, [self.keys.batch_job(job_id)], [time.time(), json.dumps(errors)])
        await self._acknowledge_intake(entry_id)

    async def _acknowledge_intake(self, entry_id: str) -> None:
        """The entry leaves tf:batch:in (acknowledged first: one found between the two is no
        longer pending, and never delivered again)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.xack(self.keys.batch_in, INGESTER_GROUP, entry_id)
        pipe.xdel(self.keys.batch_in, entry_id)
        await pipe.execute()

    # -- running ----------------------------------------------------------------------

    async def head_lines(self, job_id: str, count: int) -> list[bytes]:
        return await self.client.lrange(self.keys.batch_lines(job_id), 0, count - 1)

    async def feed(self, job: Job, model: str, num_lines: int, items: list[object], *, mode: str) -> int:
        """Queue/write off the next num_lines lines (items: the script's flat item list):
        1 done, 2 done and the job's last line is written, -1 the job is not in that state,
        -2 another ingester moved first."""
        stream = self.keys.request_stream(model, "batch", job.tenant, self.keys.partition(job.id))
        keys = [self.keys.batch_job(job.id), self.keys.batch_lines(job.id), stream,
                self.keys.batch_out(job.id), self.keys.batch_written(job.id)]
        if job.tenant is not None and mode == "run":  # the schedulers read the tenant's stream from now on
            await self.client.sadd(self.keys.tenants(model), job.tenant)
        keys += _record_keys(items)
        args = [job.next_index, num_lines, time.time(), self.record_ttl_s, mode, *_without_record_keys(items)]
        return int(await _FEED.run_async(self.client, keys, args))

    async def collect(self, job_id: str, outputs: list[LineOutput]) -> tuple[list[bool], bool]:
        """Write each line's output, once: (for each, whether this call wrote it, whether the job's
        last line was written). Lines go COLLECT_CHUNK to a script call (each call one atomic
        step), all the calls in one round trip."""
        job_keys = [self.keys.batch_job(job_id), self.keys.batch_out(job_id), self.keys.batch_written(job_id)]
        now = time.time()
        calls = []
        for start in range(0, len(outputs), COLLECT_CHUNK):
            chunk = outputs[start:start + COLLECT_CHUNK]
            keys, args = list(job_keys), [len(chunk), "", now]
            for out in chunk:
                keys += out.record_keys
                ok = "1" if out.ok else "0"
                args += [out.index, out.custom_id or "", ok, out.line, len(out.record_keys)]
            calls.append((keys, args))
        replies = await _COLLECT.run_many_async(self.client, calls)
        written = [bool(int(flag)) for reply in replies for flag in reply[:-1]]
        return written, any(int(reply[-1]) == 2 for reply in replies)

    async def written_bits(self, job_id: str) -> bytes:
        return await self.client.get(self.keys.batch_written(job_id)) or b""

    async def stop(self, job_id: str, ending: str) -> bool:
        return bool(await _STOP.run_async(self.client, [self.keys.batch_job(job_id)], [ending, time.time()]))

    async def finalize(self, job_id: str) -> bool:
        keys = [self.keys.batch_job(job_id), self.keys.batch_lines(job_id), self.keys.batch_written(job_id)]
        if not int(await _FINALIZE.run_async(self.client, keys, [time.time()])):
            return False
        await self.client.srem(self.keys.batch_active, job_id)  # (or the maintenance does, if we die)
        return True

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


def _record_keys(items: list[object]) -> list[object]:
    """The record key of each 'R' item (the ingester's flat list: 'E', index, custom_id, line |
    'R', record key, message, n, n field/value pairs), for batch_feed.lua's KEYS."""
    return [key for kind, key, *_ in _items(items) if kind == "R"]


def _without_record_keys(items: list[object]) -> list[object]:
    """The items as batch_feed.lua's ARGV reads them: an 'R' item without its record key."""
    out: list[object] = []
    for item in _items(items):
        out += item if item[0] == "E" else [item[0], *item[2:]]
    return out


def _items(items: list[object]):
    i = 0
    while i < len(items):
        size = 4 if items[i] == "E" else 4 + 2 * int(items[i + 3])
        yield items[i:i + size]
        i += size


def unwritten(bits: bytes, count: int) -> list[int]:
    """The indexes below `count` whose bit is not set (Redis counts bits from the most
    significant end of each byte); numpy, since a job may have a million lines."""
    flags = np.unpackbits(np.frombuffer(bits, dtype=np.uint8))[:count]
    missing = np.flatnonzero(flags == 0).tolist()
    return missing + list(range(len(flags), count))  # past the bitmap's end: not set either


# The app's key of this process's one JobStore (opened in gateway/http/app.py's cleanup_ctx).
JOBS = web.AppKey("jobs", JobStore)
