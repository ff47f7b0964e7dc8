"""The gateway's Redis writes and reads: queue a request, cancel it, read its record,
remember an Idempotency-Key, measure a model's queue.

Queueing is one Lua call per request (all pipelined into one round trip): the `tf:res:{id}`
record is created in state "queued" *before* the stream entry exists, so a poll never
finds nothing, and the record learns its entry id, so a cancel before any scheduler took
the request removes it from the queue. An Idempotency-Key is taken by the same call: a key
that maps to an id always has that id's record and entry, whatever dies when (a key taken by
a command of its own, and Redis or the gateway dying before the script, left the key naming a
request that was never queued: the client's retry got that id back, and a 404 for it).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError

from gateway.requests.records import ResultRecord
from gateway.routing import PrefixRouter
from protocol.keys import CONSUMER_GROUP, Keys
from protocol.messages import ErrorEvent, RequestMessage
from protocol.result_record import (
    PROGRESS_FIELDS,
    TIMING_FIELDS,
    error_json,
    parse_progress_row,
    parse_timing_row,
    queued_fields,
)

# KEYS: result hash, request stream, the model's tenant set, the tenant's lease set, the
# Idempotency-Key's key. ARGV: ttl, message, tenant ('' = none), lease lapses at ('' = no lease),
# req id, the key's value ('' = no key), the key's ttl, then field/value pairs. A tenant's
# request goes to the tenant's stream, and the tenant into the set the schedulers read; its
# lease (taken before, gateway/limits.py) now lasts its full term. An Idempotency-Key another
# request holds queues nothing: {0, what the key maps to}; else {1, entry id}.
# A request routed to a replica (gateway/routing.py) has 3 more KEYS: the replica's heartbeat,
# its drain key, its own stream. It goes there only while the heartbeat lives and no drain was
# asked for, checked here, atomically, so nothing lands in a stream its peers took over already;
# else to the shared stream. The record keeps a routed request's stream (for a cancel's XDEL).
_SUBMIT_SCRIPT = """
if ARGV[6] ~= '' and not redis.call('SET', KEYS[5], ARGV[6], 'NX', 'EX', tonumber(ARGV[7])) then
  return {0, redis.call('GET', KEYS[5])}
end
local stream = KEYS[2]
if #KEYS == 8 and redis.call('EXISTS', KEYS[6]) == 1 and redis.call('EXISTS', KEYS[7]) == 0 then
  stream = KEYS[8]
end
redis.call('HSET', KEYS[1], unpack(ARGV, 8))
local entry = redis.call('XADD', stream, '*', 'm', ARGV[2])
redis.call('HSET', KEYS[1], 'entry_id', entry)
if stream ~= KEYS[2] then redis.call('HSET', KEYS[1], 'stream', stream) end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
if ARGV[3] ~= '' then redis.call('SADD', KEYS[3], ARGV[3]) end
if ARGV[4] ~= '' then redis.call('ZADD', KEYS[4], 'XX', ARGV[4], ARGV[5]) end
return {1, entry}
"""

# A request nobody has claimed yet ends here, in the gateway (cancel, or a passed deadline):
# the same record and event a scheduler would write, and the entry leaves the queue.
# A scheduler that already read the entry finds the terminal state on claim and just acks.
# KEYS: result hash, request stream.  ARGV: state, finished_at, error json, channel, event.
_FINISH_UNCLAIMED_SCRIPT = """
if redis.call('HEXISTS', KEYS[1], 'owner') == 1 then return 0 end
if redis.call('HGET', KEYS[1], 'state') ~= 'queued' then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'finished_at', ARGV[2], 'error', ARGV[3], 'seq', 1)
redis.call('PUBLISH', ARGV[4], ARGV[5])
local entry = redis.call('HGET', KEYS[1], 'entry_id')
if entry then redis.call('XDEL', redis.call('HGET', KEYS[1], 'stream') or KEYS[2], entry) end
return 1
"""

QUEUE_KIND = "interactive"  # what the gateway writes; the batch ingester writes "batch"


GatewayKeys = Keys  # (every key the gateway uses is named in protocol/keys.py)


@dataclass
class Submission:
    req_id: str
    message: RequestMessage
    api: str  # "chat" or "completion"
    top_logprobs: int | None = None
    tool_format: str | None = None  # chat with tools: how to read calls from its text
    parallel_tool_calls: bool = True
    lease_until: float | None = None  # when its tenant lease lapses (None: it holds none)
    idempotency_key: str | None = None  # the Redis key of its Idempotency-Key (None: it has none)
    fingerprint: str = ""  # of its body, kept with the key: a reuse with another body is refused


class RequestStore:
    def __init__(self, client: aioredis.Redis, keys: GatewayKeys, *, result_ttl_s: int, cancel_ttl_s: int,
                 idempotency_ttl_s: int) -> None:
        self.client = client
        self.keys = keys
        self.result_ttl_s = result_ttl_s
        self.cancel_ttl_s = cancel_ttl_s
        self.idempotency_ttl_s = idempotency_ttl_s
        self._submit = client.register_script(_SUBMIT_SCRIPT)
        self._finish_unclaimed = client.register_script(_FINISH_UNCLAIMED_SCRIPT)
        self._depth_reads: dict[str, asyncio.Future] = {}  # model -> the queue-depth read on its way
        self.router: PrefixRouter | None = None  # set: requests may go to a replica's own stream

    # -- queueing ---------------------------------------------------------------------

    async def submit(self, submissions: list[Submission]) -> list[dict | None]:
        """Queue each, unless its Idempotency-Key maps to another request already: then nothing
        of it is written, and its answer is what the key maps to ({"id", "fingerprint"}); None
        for each one queued. One round trip for all: EVALSHA of each (a pipeline running
        registered scripts would ask SCRIPT EXISTS first, a second round trip per call); the
        script is loaded when Redis lacks it, and only the calls it refused are sent again (a
        refused EVALSHA did nothing)."""
        answers: list[dict | None] = [None] * len(submissions)
        calls = {i: self._submit_args(sub) for i, sub in enumerate(submissions)}
        while calls:
            pipe = self.client.pipeline(transaction=False)
            for keys, args in calls.values():
                pipe.evalsha(self._submit.sha, len(keys), *keys, *args)
            results = await pipe.execute(raise_on_error=False)
            failed = {}
            for (i, call), result in zip(calls.items(), results, strict=True):
                if isinstance(result, NoScriptError):
                    failed[i] = call
                elif isinstance(result, Exception):
                    raise result
                elif not result[0]:
                    answers[i] = json.loads(result[1])
            if failed:
                await self.client.script_load(_SUBMIT_SCRIPT)
            calls = failed
        return answers

    def _submit_args(self, sub: Submission) -> tuple[list[str], list[object]]:
        message = sub.message
        tenant = message.tenant  # (the terminal write ends its lease by it)
        fields = queued_fields(model=message.model, api=sub.api, queued_at=message.arrival_time,
                               prompt_tokens=len(message.prompt_token_ids), deadline=message.deadline,
                               top_logprobs=sub.top_logprobs, tool_format=sub.tool_format,
                               parallel_tool_calls=sub.parallel_tool_calls, tenant=tenant)
        idempotency = "" if sub.idempotency_key is None else json.dumps(
            {"id": sub.req_id, "fingerprint": sub.fingerprint})
        args: list[object] = [self.result_ttl_s, message.encode(), tenant or "",
                              "" if sub.lease_until is None else sub.lease_until, sub.req_id,
                              idempotency, self.idempotency_ttl_s]
        for name, value in fields.items():
            args += [name, value]
        stream = self.keys.request_stream(message.model, QUEUE_KIND, tenant)
        idempotency_key = sub.idempotency_key or self.keys.idempotency("-")  # (untouched without a value)
        keys = [self.keys.result(sub.req_id), stream, self.keys.tenants(message.model),
                self.keys.tenant_leases(tenant or "-"), idempotency_key]
        route = self.router.route(message.model, message.prompt_token_ids) if self.router else None
        if route is not None and route.scheduler_id is not None:
            replica = route.scheduler_id
            keys += [self.keys.scheduler(replica), self.keys.drain(replica),
                     self.keys.replica_stream(message.model, replica)]
        return keys, args

    async def queue_depth(self, model: str) -> int:
        """Entries of the model's interactive stream that no scheduler has taken yet. Callers
        that ask while a read is on its way share it (a burst of requests, each admitted
        against the depth, costs one read, not one per request): an answer at most one Redis
        round trip older than a read of the caller's own."""
        pending = self._depth_reads.get(model)
        if pending is None:
            pending = asyncio.ensure_future(self._read_queue_depth(model))
            self._depth_reads[model] = pending
            pending.add_done_callback(lambda done: self._read_done(model, done))
        return await asyncio.shield(pending)

    def _read_done(self, model: str, done: asyncio.Future) -> None:
        if self._depth_reads.get(model) is done:
            del self._depth_reads[model]
        if not done.cancelled():
            done.exception()  # retrieved here too: every caller may have left before it ended

    async def _read_queue_depth(self, model: str) -> int:
        """Over the model's plain stream, every tenant's and every replica's own one."""
        pipe = self.client.pipeline(transaction=False)
        pipe.smembers(self.keys.tenants(model))
        pipe.smembers(self.keys.replica_streams(model))
        tenants, replicas = await pipe.execute()
        streams = [self.keys.request_stream(model, QUEUE_KIND)]
        streams += [self.keys.request_stream(model, QUEUE_KIND, t.decode()) for t in sorted(tenants)]
        streams += [self.keys.replica_stream(model, r.decode()) for r in sorted(replicas)]
        pipe = self.client.pipeline(transaction=False)
        for stream in streams:
            pipe.xlen(stream)
            pipe.xpending(stream, CONSUMER_GROUP)
        replies = await pipe.execute(raise_on_error=False)
        depth = 0
        for length, pending in zip(replies[::2], replies[1::2], strict=True):
            if isinstance(length, Exception):
                raise length
            taken = 0 if isinstance(pending, ResponseError) else int(pending["pending"])
            depth += max(0, int(length) - taken)
        return depth

    # -- cancelling -------------------------------------------------------------------

    async def cancel(self, req_ids: list[str]) -> None:
        """End to end: the flag (for a scheduler that missed the message) and the message."""
        if not req_ids:
            return
        pipe = self.client.pipeline(transaction=False)
        for req_id in req_ids:
            pipe.set(self.keys.cancelled(req_id), 1, ex=self.cancel_ttl_s)
            pipe.publish(self.keys.cancel_channel, req_id)
        await pipe.execute()

    async def finish_unclaimed(self, record: ResultRecord, state: str, message: str) -> bool:
        """End a request no scheduler has claimed (cancel, expiry); False if one has."""
        if record.model is None:
            return False
        error = error_json(state, message)
        event = ErrorEvent(record.req_id, 1, state, message).encode()
        stream = self.keys.request_stream(record.model, QUEUE_KIND, record.tenant)
        done = await self._finish_unclaimed(
            keys=[self.keys.result(record.req_id), stream],
            args=[state, time.time(), error, self.keys.events(record.req_id), event],
        )
        if done and record.tenant is not None:  # ended here, not by a scheduler: so is its lease
            await self.client.zrem(self.keys.tenant_leases(record.tenant), record.req_id)
        return bool(done)

    # -- reading ----------------------------------------------------------------------

    async def read(self, req_id: str) -> ResultRecord | None:
        return ResultRecord.parse(req_id, await self.client.hgetall(self.keys.result(req_id)))

    async def read_many(self, req_ids: list[str]) -> list[ResultRecord | None]:
        pipe = self.client.pipeline(transaction=False)
        for req_id in req_ids:
            pipe.hgetall(self.keys.result(req_id))
        raws = await pipe.execute()
        return [ResultRecord.parse(r, raw) for r, raw in zip(req_ids, raws, strict=True)]

    async def progress(self, req_ids: list[str]) -> list[tuple[str | None, int, bool]]:
        """(state, seq, is past its deadline unclaimed) of each request: a cheap look first."""
        pipe = self.client.pipeline(transaction=False)
        for req_id in req_ids:
            pipe.hmget(self.keys.result(req_id), PROGRESS_FIELDS)
        rows = await pipe.execute()
        now = time.time()
        out = []
        for row in rows:
            state, seq, owner, deadline = parse_progress_row(row)
            is_due = state == "queued" and owner is None and deadline is not None and now > deadline
            out.append((state, seq, is_due))
        return out

    async def timings(self, req_ids: list[str]) -> list[tuple[float | None, float | None]]:
        """(queued_at, started_at) of each request, for the queue-time histogram."""
        if len(req_ids) == 1:  # a plain command: cheaper than a pipeline of one
            rows = [await self.client.hmget(self.keys.result(req_ids[0]), TIMING_FIELDS)]
        else:
            pipe = self.client.pipeline(transaction=False)
            for req_id in req_ids:
                pipe.hmget(self.keys.result(req_id), TIMING_FIELDS)
            rows = await pipe.execute()
        return [parse_timing_row(row) for row in rows]

    # -- idempotency ------------------------------------------------------------------

    def idempotency_key(self, api_key: str | None, key: str) -> str:
        return self.keys.idempotency_for(api_key, key)

    async def find_idempotency(self, redis_key: str) -> dict | None:
        value = await self.client.get(redis_key)
        return json.loads(value) if value is not None else None
