"""The gateway's Redis writes and reads: queue a request, cancel it, read its record,
remember an Idempotency-Key, measure a model's queue.

Queueing is one Lua call per request (protocol/lua/submit.lua; all pipelined into one round
trip): the `tf:res:{P}:{id}` record is created in state "queued" *before* the stream entry
exists, so a poll never finds nothing, and the record learns its entry id, so a cancel before
any scheduler took the request removes it from the queue. An Idempotency-Key is taken by the
same call (the request's id is drawn in the key's partition, so both are on one slot): a key
that maps to an id always has that id's record and entry, whatever dies when (a key taken by
a command of its own, and Redis or the gateway dying before the script, left the key naming a
request that was never queued: the client's retry got that id back, and a 404 for it).

A tenant's request also adds the tenant to the model's tenant set (before the call: schedulers
then find its stream) and makes its lease last its full term (after: protocol/lua/extend_leases.lua
renews only a lease the gateway took, gateway/tenants/limits.py, and that a fast terminal write has not
ended yet, and keeps the lease set's TTL past its latest lease).
On one server all of it is one pipeline, which Redis runs in order (one round trip, not three);
on a cluster those keys live on other shards, so they are pipelines of their own, before and
after the scripts; and a submit counts as accepted only once a replica has it (`WAIT 1`, per
shard).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from aiohttp import web
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from gateway.fleet.routing import PrefixRouter
from gateway.serving.records import ResultRecord
from protocol import lua
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
from shared.redis_client import REPLICA_WAIT_MS, is_cluster_client, unreplicated_async

QUEUE_KIND = "interactive"  # what the gateway writes; the batch ingester writes "batch"


GatewayKeys = Keys  # (every key the gateway uses is named in protocol/keys.py)


@dataclass
class Submission:
    req_id: str
    message: RequestMessage
    api: str  # "chat" or "completion"
    top_logprobs: int | None = None
    prompt_top_logprobs: int | None = None  # vLLM's prompt_logprobs, as asked
    echo: tuple[str, bool] | None = None  # a completion with echo: (prompt text, prompt only)
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
        self.is_cluster = is_cluster_client(client)
        self._submit = lua.Script("submit")
        self._finish_unclaimed = lua.Script("finish_unclaimed", sharded=self.is_cluster)
        self._extend_leases = lua.Script("extend_leases")
        self._depth_reads: dict[str, asyncio.Future] = {}  # model -> the queue-depth read on its way
        self.router: PrefixRouter | None = None  # set: requests may go to a replica's own stream

    # -- queueing ---------------------------------------------------------------------

    async def submit(self, submissions: list[Submission]) -> list[dict | None]:
        """Queue each, unless its Idempotency-Key maps to another request already: then nothing
        of it is written, and its answer is what the key maps to ({"id", "fingerprint"}); None
        for each one queued. One round trip for all (on a cluster, one per shard, the tenant
        keys' and the replicas' confirmation)."""
        calls = [self._submit_call(sub) for sub in submissions]
        tenanted = [sub for sub in submissions if sub.message.tenant is not None]
        if tenanted and not self.is_cluster:
            return await self._submit_on_one_server(submissions, calls, tenanted)
        if tenanted:  # (before: a scheduler that sees the entry finds the tenant's stream)
            pipe = self.client.pipeline(transaction=False)
            for sub in tenanted:
                pipe.sadd(self.keys.tenants(sub.message.model), sub.message.tenant)
            await pipe.execute()
        results = await self._submit.run_many_async(self.client, calls)
        answers: list[dict | None] = [None if result[0] else json.loads(result[1]) for result in results]
        leases = [sub for sub, answer in zip(submissions, answers, strict=True)
                  if answer is None and sub.lease_until is not None]
        if leases:
            await self._extend_leases.run_many_async(self.client, [self._lease_call(sub) for sub in leases])
        if self.is_cluster:
            await self._wait_for_replicas([call[0][0] for call in calls])
        return answers

    async def _submit_on_one_server(self, submissions: list[Submission], calls: list,
                                    tenanted: list[Submission]) -> list[dict | None]:
        """Tenants' requests on one server: the tenant set, the scripts and the leases in one
        pipeline, which Redis runs in order (the set before the entries, the leases after).
        A lease is renewed for a request whose Idempotency-Key queued nothing too: its caller
        ends that lease at once (gateway/api/requests/api.py)."""
        pipe = self.client.pipeline(transaction=False)
        for sub in tenanted:
            pipe.sadd(self.keys.tenants(sub.message.model), sub.message.tenant)
        for keys, args in calls:
            pipe.execute_command("EVALSHA", self._submit.sha, len(keys), *keys, *args)
        lease_calls = [self._lease_call(sub) for sub in submissions if sub.lease_until is not None]
        for keys, args in lease_calls:
            pipe.execute_command("EVALSHA", self._extend_leases.sha, len(keys), *keys, *args)
        replies = await pipe.execute(raise_on_error=False)
        results = replies[len(tenanted):len(tenanted) + len(calls)]
        for reply in replies:
            if isinstance(reply, Exception) and not isinstance(reply, NoScriptError):
                raise reply
        unloaded = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
        if unloaded:  # (Redis lost its scripts: a restart) the set is written already
            for i, result in zip(unloaded, await self._submit.run_many_async(self.client,
                                                                             [calls[i] for i in unloaded]),
                                 strict=True):
                results[i] = result
        lease_replies = replies[len(tenanted) + len(calls):]
        unrenewed = [call for call, reply in zip(lease_calls, lease_replies, strict=True)
                     if isinstance(reply, NoScriptError)]
        if unrenewed:  # (after the entries, as in the pipeline)
            await self._extend_leases.run_many_async(self.client, unrenewed)
        return [None if result[0] else json.loads(result[1]) for result in results]

    def _lease_call(self, sub: Submission) -> tuple[list[str], list[object]]:
        """protocol/lua/extend_leases.lua's KEYS and ARGV: the request's lease for its full term."""
        return [self.keys.tenant_leases(sub.message.tenant)], [time.time(), sub.lease_until, sub.req_id]

    async def _wait_for_replicas(self, record_keys: list[str]) -> None:
        """Accepted only once on a replica: WAIT 1 on each shard the submit wrote to. A shard
        whose replica does not confirm in time fails the submit (503: the client retries, with
        its Idempotency-Key if it gave one), rather than accept what a failover could lose."""
        nodes = {node.name: node for node in map(self.client.get_node_from_key, record_keys)}
        late = await unreplicated_async(self.client, list(nodes.values()))
        if late:
            raise RedisConnectionError(f"no replica of the Redis shard(s) {', '.join(late)} confirmed the "
                                       f"request within {REPLICA_WAIT_MS} ms")

    def _submit_call(self, sub: Submission) -> tuple[list[str], list[object]]:
        """protocol/lua/submit.lua's KEYS and ARGV for one request (named in its header)."""
        message = sub.message
        tenant = message.tenant  # (the terminal write ends its lease by it)
        fields = queued_fields(model=message.model, api=sub.api, queued_at=message.arrival_time,
                               prompt_tokens=len(message.prompt_token_ids), deadline=message.deadline,
                               top_logprobs=sub.top_logprobs, tool_format=sub.tool_format,
                               prompt_top_logprobs=sub.prompt_top_logprobs, echo=sub.echo,
                               parallel_tool_calls=sub.parallel_tool_calls, tenant=tenant)
        idempotency = "" if sub.idempotency_key is None else json.dumps(
            {"id": sub.req_id, "fingerprint": sub.fingerprint})
        # (no Idempotency-Key: a key of the request's own slot that the script leaves alone)
        idempotency_key = sub.idempotency_key or self.keys.idempotency(sub.req_id)
        stream = self.keys.stream_for(sub.req_id, message.model, QUEUE_KIND, tenant)
        keys = [self.keys.result(sub.req_id), stream, idempotency_key]
        args: list[object] = [self.result_ttl_s, message.encode(), idempotency, self.idempotency_ttl_s]
        for name, value in fields.items():
            args += [name, value]
        route = (self.router.route(message.model, message.prompt_token_ids, message.lora_name)
                 if self.router else None)
        if route is not None and route.scheduler_id is not None and not self.is_cluster:
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
        """Over the model's plain stream, every tenant's and every replica's own one (each
        partition's)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.smembers(self.keys.tenants(model))
        pipe.smembers(self.keys.replica_streams(model))
        tenants, replicas = await pipe.execute()
        streams = self.keys.request_streams(model, QUEUE_KIND)
        for tenant in sorted(tenants):
            streams += self.keys.request_streams(model, QUEUE_KIND, tenant.decode())
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
        stream = record.stream or self.keys.stream_for(record.req_id, record.model, QUEUE_KIND, record.tenant)
        done = await self._finish_unclaimed.run_async(
            self.client, [self.keys.result(record.req_id), stream],
            [state, time.time(), error, self.keys.events(record.req_id), event])
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


# The app's key of this process's one RequestStore (opened in gateway/http/app.py's cleanup_ctx).
STORE = web.AppKey("store", RequestStore)
