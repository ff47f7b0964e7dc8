"""The batch ingester: takes jobs from `tf:batch:in`, queues their lines as batch requests,
and writes each line's result to `tf:batch:{job}:out`. It runs inside every gateway process
(and alone, as `tokenfleet batch ingester`); any number run side by side.

Four loops:
- intake: one entry of `tf:batch:in` (consumer group "ingesters") -> the job checked line by
  line, its lines staged, then committed in one atomic step (jobs.py);
- feed: every active job is topped up to `batch_max_inflight` queued-but-unwritten lines
  (each line's requests made by line_requests.py), a compare-and-set per chunk, so that a
  million-line job holds at most that many requests in Redis at once;
- collect: the schedulers append a notice to `tf:batch:done` with each batch item's terminal
  state; the line's output is built (the same response object the REST route answers) and
  appended once (a bitmap per job makes a repeat a no-op);
- maintenance: entries and notices a dead ingester left pending are taken over after
  `batch_lease_s`; jobs past their window expire; stopping jobs have their queued items
  cancelled and their unqueued lines written off; finished jobs are finalized.
Nothing is acknowledged before its effect is written, so a killed ingester loses nothing: a
successor redoes what was pending, and the atomic steps make the redo harmless.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import socket
import time
import uuid

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.api.batch.entry import ENTRY_FIELDS, JobRefused, check_entry, job_id_for_entry
from gateway.api.batch.jobs import (
    IntakeLost,
    Job,
    JobStore,
    LineOutput,
    item_req_id,
    parse_item_req_id,
    unwritten,
)
from gateway.api.batch.line_requests import LineRequests
from gateway.api.batch.lines import (
    LineItem,
    check_lines,
    endpoint_mismatch,
    split_lines,
)
from gateway.api.batch.notices import read_notices
from gateway.api.batch.record import TERMINAL_JOB_STATES
from gateway.api.models.adapters import find_adapter
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import GatewaySettings
from gateway.errors import GatewayError
from gateway.serving.records import ResultRecord
from gateway.serving.store import RequestStore
from gateway.tenants.registry import TenantRegistry
from gateway.tokens.models import ModelRegistry
from protocol.abandoned import claim_abandoned_async
from protocol.keys import INGESTER_GROUP, JOB_ID_PATTERN, Keys
from protocol.result_record import F
from shared.logging import get_logger

FEED_CHUNK = 128  # lines queued per compare-and-set

log = get_logger("tokenfleet.batch")


class BatchIngester:
    def __init__(self, client: aioredis.Redis, keys: Keys, models: ModelRegistry, settings: GatewaySettings,
                 consumer: str | None = None, metrics: GatewayMetrics | None = None) -> None:
        self.client = client
        self.keys = keys
        self.models = models
        self.settings = settings
        self.jobs = JobStore(client, keys, record_ttl_s=settings.result_ttl_s)
        self.lines = LineRequests(client, keys, models, settings)  # a line as requests, and back
        # Whose limits a tenant's job feeds under (its max_batch_lines_in_flight).
        self.tenants = TenantRegistry(settings.tenants, client if settings.tenants_from_redis else None, keys)
        # The gateway's own cancel (flag + message), for the queued lines of a stopping job.
        self.requests = RequestStore(client, keys, result_ttl_s=settings.result_ttl_s,
                                     cancel_ttl_s=settings.cancel_ttl_s,
                                     idempotency_ttl_s=settings.idempotency_ttl_s)
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._wake_feeder = asyncio.Event()
        self._lease_ms = int(settings.batch_lease_s * 1000)
        self.metrics = metrics or GatewayMetrics()  # the gateway's, when it runs inside one
        self._intaking: set[str] = set()  # entries of tf:batch:in this process is taking in now

    # -- the loops ----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        loops = [self._intake_loop, self._feed_loop, self._collect_loop, self._maintenance_loop]
        tasks = [asyncio.create_task(self._guarded(loop, stop), name=f"batch-{loop.__name__}")
                 for loop in loops]
        log.info("batch_ingester_started", consumer=self.consumer)
        try:
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _guarded(self, loop, stop: asyncio.Event) -> None:
        """Run a loop forever: Redis outages back off, other errors are logged, not fatal."""
        backoff = 0.1
        while not stop.is_set():
            try:
                await self._ensure_groups()
                await loop(stop)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                log.warning("batch_redis_unreachable", loop=loop.__name__, error=str(exc), retry_in_s=backoff)
            except Exception as exc:  # noqa: BLE001 - one bad job must not stop the others
                log.exception("batch_loop_failed", loop=loop.__name__, error=repr(exc))
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _ensure_groups(self) -> None:
        for stream in (self.keys.batch_in, *self.keys.batch_done_streams):
            try:
                await self.client.xgroup_create(stream, INGESTER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def _intake_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            response = await self.client.xreadgroup(INGESTER_GROUP, self.consumer, {self.keys.batch_in: ">"},
                                                    count=1, block=1000)
            for _, entries in response or []:
                for entry_id, fields in entries:
                    await self.intake(entry_id.decode(), fields or {})

    async def _feed_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(self._wake_feeder.wait(), timeout=0.2)
            except TimeoutError:
                pass
            self._wake_feeder.clear()
            for job_id in await self.jobs.active():
                try:
                    while await self.feed(job_id):
                        pass
                except (RedisConnectionError, RedisTimeoutError, OSError):
                    raise
                except Exception as exc:  # noqa: BLE001 - one broken job must not starve the others
                    log.exception("batch_feed_failed", job_id=job_id, error=repr(exc))

    async def _collect_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():  # (each partition's notices on a cluster: gateway/api/batch/notices.py)
            notices = await read_notices(self.client, self.consumer, self.keys.batch_done_streams)
            for stream, entries in notices:
                await self.collect(entries, stream)

    async def _maintenance_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.maintain()
            try:
                await asyncio.wait_for(stop.wait(), timeout=max(0.2, self.settings.batch_lease_s / 4))
            except TimeoutError:
                pass

    # -- intake -------------------------------------------------------------------------

    async def intake(self, entry_id: str, raw_fields: dict) -> str | None:
        """Take one job in; returns its id (None when this process is at it already). Safe to
        repeat for the same entry. A big job's intake outlasts the lease, so the claim on its
        entry is renewed meanwhile: nobody else (nor this process's own takeover) starts a
        second intake that would interleave its staging with ours."""
        if entry_id in self._intaking:
            return None
        self._intaking.add(entry_id)
        renewal = asyncio.create_task(self._renew_claim(entry_id), name="batch-renew-intake")
        try:
            return await self._intake(entry_id, raw_fields)
        except IntakeLost as exc:  # our claim lapsed and another ingester took the entry over
            log.warning("batch_intake_taken_over", entry_id=entry_id, job_id=str(exc))
            return None
        finally:
            renewal.cancel()
            await asyncio.gather(renewal, return_exceptions=True)
            self._intaking.discard(entry_id)

    async def _renew_claim(self, entry_id: str) -> None:
        while True:
            await asyncio.sleep(self.settings.batch_lease_s / 3)
            await self.client.xclaim(self.keys.batch_in, INGESTER_GROUP, self.consumer, 0, [entry_id],
                                     justid=True)

    async def _intake(self, entry_id: str, raw_fields: dict) -> str:
        fields = {k.decode() if isinstance(k, bytes) else k: v for k, v in raw_fields.items()}
        text = {k: (v.decode(errors="replace") if isinstance(v, bytes) else str(v))
                for k, v in fields.items() if k != "lines"}
        job_id = text.get("job_id") or job_id_for_entry(entry_id)
        problems: list[dict] = []
        if not re.match(JOB_ID_PATTERN, job_id):
            problems.append(JobRefused("invalid_job_id",
                                       f"job_id {job_id[:80]!r} must match {JOB_ID_PATTERN}", "job_id").error)
            job_id = job_id_for_entry(entry_id)
        described = {k: text[k] for k in ENTRY_FIELDS if k in text and k not in ("job_id", "lines")}
        window = 0.0
        try:
            window = check_entry(fields, text)
        except JobRefused as exc:  # refused below, once the job exists; a bad value is not kept
            problems.append(exc.error)
            described.pop(exc.error["param"], None)
        token = uuid.uuid4().hex  # fences this intake's staging against one that takes it over
        existing = await self.jobs.begin(job_id, entry_id, described, token)
        if existing is not None and existing.fields.get("entry_id") != entry_id:
            problems.append(JobRefused("duplicate_job_id",
                                       f"job_id {job_id!r} is already taken by another job", "job_id").error)
            job_id = job_id_for_entry(entry_id)
            existing = await self.jobs.begin(job_id, entry_id, described, token)
        if existing is not None and existing.fields.get("committed"):
            await self.jobs.commit(job_id, entry_id, existing.total, existing.expires_at or 0)  # acks only
            return job_id
        try:
            if problems:
                raise JobRefused(**problems[0])
            items, model = await self._check(fields, text)
        except JobRefused as exc:
            await self.jobs.refuse(job_id, entry_id, [exc.error])
            self.metrics.batch_jobs.labels("failed").inc()
            log.info("batch_job_refused", job_id=job_id, error=exc.error["message"])
            return job_id
        await self.client.hset(self.keys.batch_job(job_id), "model", model or "")
        packed = await asyncio.to_thread(lambda: [item.pack() for item in items])  # off the event loop
        await self.jobs.stage(job_id, packed, token)
        if not await self.jobs.commit(job_id, entry_id, len(items), time.time() + window, token):
            return job_id  # committed by an intake that took ours over meanwhile
        log.info("batch_job_started", job_id=job_id, lines=len(items), model=model,
                 refused_lines=sum(1 for item in items if item.error))
        self._wake_feeder.set()
        return job_id

    async def _check(self, fields: dict, text: dict) -> tuple[list[LineItem], str | None]:
        endpoint = text.get("endpoint")
        content = await self._content(fields, text)
        if endpoint is not None:  # a line for another endpoint refuses the job, as OpenAI does
            mismatch = await asyncio.to_thread(endpoint_mismatch, content, endpoint)
            if mismatch is not None:
                raise JobRefused("endpoint_mismatch", mismatch.message, mismatch.param, mismatch.line)
        raws = await asyncio.to_thread(split_lines, content)  # a big job's lines: off the event loop
        if not raws:
            raise JobRefused("empty_job", "the job has no lines", "lines")
        if len(raws) > self.settings.batch_max_lines:
            raise JobRefused("too_many_lines", f"the job has {len(raws)} lines; at most "
                             f"{self.settings.batch_max_lines} are allowed", "lines")
        items, model = await asyncio.to_thread(check_lines, raws, model=text.get("model"))
        if model is not None and model not in self.models.names:  # a LoRA adapter's name, or nothing
            owner = text.get("tenant")
            if await find_adapter(self.client, self.keys, self.models, model,
                                  lambda record: record.owner in (None, owner)) is None:
                try:
                    self.models.get(model)
                except GatewayError as exc:
                    raise JobRefused("model_not_found", exc.message, "model") from None
        elif len(self.models.names) == 1 and any(item.error is None for item in items):
            model = self.models.names[0]
        return items, model

    async def _content(self, fields: dict, text: dict) -> str:
        has_lines, has_file = "lines" in fields, "input_file_id" in text
        if has_lines == has_file:
            raise JobRefused("missing_input", "give the job's lines in 'lines' or an uploaded file in "
                             "'input_file_id', one of the two", "lines")
        if has_lines:
            raw = fields["lines"]
        else:
            raw = await self.client.hget(self.keys.file(text["input_file_id"]), "content")
            if raw is None:
                raise JobRefused("file_not_found", f"no file {text['input_file_id']!r}", "input_file_id")
        try:
            return raw.decode() if isinstance(raw, bytes) else str(raw)
        except UnicodeDecodeError as exc:
            raise JobRefused("invalid_encoding", f"the job's lines are not UTF-8: {exc}", "lines") from None

    # -- feeding --------------------------------------------------------------------------

    async def feed(self, job_id: str) -> bool:
        """Queue (or, for a stopping job, write off) the next chunk; True if more may follow."""
        job = await self.jobs.get(job_id)
        if job is None or job.status not in ("in_progress", "cancelling"):
            return False
        remaining = job.total - job.next_index
        if remaining <= 0:
            return False
        if job.ending:
            count = min(FEED_CHUNK * 8, remaining)
        else:
            count = min(FEED_CHUNK, remaining, self.settings.batch_max_inflight - job.in_flight,
                        await self._tenant_room(job))
        if count <= 0:
            return False
        raws = await self.jobs.head_lines(job_id, count)
        items = [LineItem.unpack(raw) for raw in raws]
        target = await self.lines.target(job)
        make = self.lines.written_off if job.ending else functools.partial(self.lines.queued, target=target)
        parts = [make(job, item) for item in items]  # each: ["E", ...] written now, or ["R", ...] queued
        args = [arg for part in parts for arg in part]
        mode = "end" if job.ending else "run"
        result = await self.jobs.feed(job, target[0] or "", len(items), args, mode=mode)
        if result in (1, 2):
            self.metrics.batch_lines.labels("failed").inc(sum(1 for part in parts if part[0] == "E"))
        if result == 2:
            await self._finalize(job_id)
        return result in (1, -2)  # -2: another ingester moved first; look again

    async def _tenant_room(self, job: Job) -> int:
        """Lines the job's tenant may still have queued (its max_batch_lines_in_flight, over all
        its jobs). Ingesters feeding two of its jobs at once may overshoot by a chunk each."""
        tenant = await self.tenants.get(job.tenant) if job.tenant is not None else None
        cap = tenant.limits.max_batch_lines_in_flight if tenant is not None else None
        if cap is None:
            return FEED_CHUNK
        return cap - await self.jobs.tenant_lines_in_flight(tenant.name)

    # -- collecting -----------------------------------------------------------------------

    async def collect(self, notices: list, stream: str | None = None) -> None:
        """Write the output of every line whose notices arrived (once all its choices ended): per
        job, its lines' records read in one round trip and their outputs written in another."""
        lines: dict[str, dict[int, None]] = {}  # job -> its lines, in the notices' order
        for _, fields in notices:
            try:
                job_id, index, _ = parse_item_req_id(fields[b"req"].decode())
            except (KeyError, ValueError):
                continue  # not ours to understand; acknowledged below so it does not loop
            lines.setdefault(job_id, {})[index] = None
        for job_id, indexes in lines.items():
            job = await self.jobs.get(job_id)
            if job is not None and await self._collect_lines(job, list(indexes)):
                await self._finalize(job_id)
        if notices:
            entry_ids = [entry_id for entry_id, _ in notices]
            stream = stream or self.keys.batch_done
            pipe = self.client.pipeline(transaction=False)  # (acknowledged first: never deleted yet pending)
            pipe.xack(stream, INGESTER_GROUP, *entry_ids)
            pipe.xdel(stream, *entry_ids)
            await pipe.execute()
        self._wake_feeder.set()

    async def _collect_lines(self, job: Job, indexes: list[int]) -> bool:
        """Each ready line's output written; True if the job's last line was. A line whose records
        are gone (written and cleaned up already) or not all terminal is left alone: its last
        choice's notice brings it here again."""
        firsts = [group[0] for group in
                  await self._read_records([[item_req_id(job.id, index, 0)] for index in indexes])]
        req_ids = [[item_req_id(job.id, index, c) for c in range(1, first.batch_n or 1)] if first else []
                   for index, first in zip(indexes, firsts, strict=True)]
        others = await self._read_records(req_ids)
        target = await self.lines.target(job)
        outputs: list[LineOutput] = []
        for index, first, rest, rest_ids in zip(indexes, firsts, others, req_ids, strict=True):
            if first is None or any(r is None or not r.is_terminal for r in (first, *rest)):
                continue
            item = LineItem(index, first.batch_line, first.custom_id)
            ok, line = self.lines.output(job, item, [first, *rest], target)
            record_keys = [self.keys.result(r) for r in (item_req_id(job.id, index, 0), *rest_ids)]
            outputs.append(LineOutput(index, first.custom_id, ok, line, record_keys))
        if not outputs:
            return False
        written, finished = await self.jobs.collect(job.id, outputs)
        for out, is_new in zip(outputs, written, strict=True):
            if is_new:
                self.metrics.batch_lines.labels("completed" if out.ok else "failed").inc()
        return finished

    async def _read_records(self, req_ids: list[list[str]]) -> list[list[ResultRecord | None]]:
        """The records of each group of request ids, in one round trip for all."""
        if not any(req_ids):
            return [[] for _ in req_ids]
        pipe = self.client.pipeline(transaction=False)
        for group in req_ids:
            for req_id in group:
                pipe.hgetall(self.keys.result(req_id))
        raws = iter(await pipe.execute())
        return [[ResultRecord.parse(req_id, next(raws)) for req_id in group] for group in req_ids]

    # -- maintenance ----------------------------------------------------------------------

    async def maintain(self) -> None:
        await self._take_over_pending()
        active = await self.jobs.active()
        self.metrics.batch_jobs_active.set(len(active))
        for job_id in active:
            job = await self.jobs.get(job_id)
            if job is None or job.status in TERMINAL_JOB_STATES:  # (gone, or its finalizer died)
                await self.client.srem(self.keys.batch_active, job_id)
                continue
            if job.status == "finalizing":  # its last writer died before finalizing it
                await self._finalize(job_id)
                continue
            if not job.ending and job.expires_at is not None and time.time() > job.expires_at:
                await self.jobs.stop(job_id, "expired")
                job = await self.jobs.get(job_id)
            if job is not None and job.ending:
                await self._cancel_queued(job)
                self._wake_feeder.set()

    async def _finalize(self, job_id: str) -> None:
        if await self.jobs.finalize(job_id):
            job = await self.jobs.get(job_id)
            self.metrics.batch_jobs.labels(job.status).inc()
            log.info("batch_job_ended", job_id=job_id, status=job.status, total=job.total,
                     failed=int(job.fields.get("failed") or 0))

    async def _take_over_pending(self) -> None:
        """What an ingester that died left pending: after the lease, someone else does it."""
        entries, gone = await claim_abandoned_async(self.client, self.keys.batch_in, INGESTER_GROUP,
                                                    self.consumer, self._lease_ms, count=4)
        for entry_id, fields in entries:
            log.info("batch_entry_taken_over", entry_id=entry_id.decode())
            await self.intake(entry_id.decode(), fields or {})
        num_gone_notices = 0
        for stream in self.keys.batch_done_streams:
            notices, gone_notices = await claim_abandoned_async(self.client, stream, INGESTER_GROUP,
                                                                self.consumer, self._lease_ms, count=512)
            num_gone_notices += len(gone_notices)
            if notices:
                await self.collect(notices, stream)
        if gone or num_gone_notices:
            log.warning("batch_pending_entries_gone", jobs=len(gone), notices=num_gone_notices)

    async def _cancel_queued(self, job: Job) -> None:
        """Every queued line of a stopping job, cancelled end to end (the flag survives a
        scheduler that has not read the entry yet: it finds the flag and ends it unrun)."""
        bits = await self.jobs.written_bits(job.id)
        pending = unwritten(bits, job.next_index)
        if not pending:
            return
        pipe = self.client.pipeline(transaction=False)
        for index in pending:
            pipe.hget(self.keys.result(item_req_id(job.id, index, 0)), F.BATCH_N)
        counts = await pipe.execute()
        await self.requests.cancel([item_req_id(job.id, index, c)
                                    for index, n in zip(pending, counts, strict=True)
                                    for c in range(int(n or 1))])
