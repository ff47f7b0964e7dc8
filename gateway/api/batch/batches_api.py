"""/v1/batches: OpenAI's batch API over tokenfleet's batch jobs (create from an uploaded file,
retrieve, list, cancel). A job created here is the same thing as one written straight into
`tf:batch:in` by any Redis client; this route just writes that entry (and the job's record,
in one atomic step, so the job can be read back at once: JobStore.create). With tenants, a
job is its tenant's: another tenant's is a 404 and lists show one's own (gateway/tenants/access.py)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

from aiohttp import web
from pydantic import Field

from gateway.api.batch.entry import check_metadata, parse_window
from gateway.api.batch.files_api import FILE_ID_PATTERN, stored_file
from gateway.api.batch.jobs import JOB_STATES, JOBS, Job, new_job_id
from gateway.api.batch.lines import URLS, endpoint_mismatch
from gateway.core.appkeys import REDIS
from gateway.core.shapes import Shape, StrictModel
from gateway.errors import BadRequest, Conflict, NotFound
from gateway.serving.handlers import read_body
from gateway.tenants.access import TENANT, caller, visible_ids
from protocol.keys import JOB_ID_PATTERN


class BatchCreate(StrictModel):
    input_file_id: str = Field(pattern=FILE_ID_PATTERN)
    endpoint: Literal[URLS]
    completion_window: str = Field("24h", description="a duration: 24h (OpenAI's only value), 90m, 3600s...")
    metadata: dict[str, str] | None = Field(None, max_length=16)


class RequestCounts(Shape):
    total: int
    completed: int
    failed: int


class BatchObject(Shape):
    id: str
    object: Literal["batch"]
    endpoint: str | None
    status: Literal[JOB_STATES]
    input_file_id: str | None
    completion_window: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int | None
    request_counts: RequestCounts
    metadata: dict | None


class BatchList(Shape):
    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


async def _job(request: web.Request) -> Job:
    """The job of the path, if the caller may see it (another tenant's is no batch to it)."""
    job_id = request.match_info["batch_id"]
    job = await request.app[JOBS].get(job_id) if re.match(JOB_ID_PATTERN, job_id) else None
    if job is None or not caller(request).can_see(job.tenant):
        raise NotFound(f"no batch {job_id[:100]!r}", param="batch_id")
    return job


async def create(request: web.Request) -> web.Response:
    body, _ = await read_body(request, BatchCreate)
    try:
        parse_window(body.completion_window)
    except ValueError as exc:
        raise BadRequest(str(exc), param="completion_window") from None
    if body.metadata is not None:
        try:
            check_metadata(body.metadata)
        except ValueError as exc:
            raise BadRequest(str(exc), param="metadata") from None
    jobs = request.app[JOBS]
    await stored_file(request, body.input_file_id, param="input_file_id")  # one the caller may read
    content = await request.app[REDIS].hget(jobs.keys.file(body.input_file_id), "content")
    if content is None:
        raise NotFound(f"no file {body.input_file_id!r}", param="input_file_id")
    await _check_endpoint(content, body.endpoint)
    job_id = new_job_id()
    fields = {"input_file_id": body.input_file_id, "endpoint": body.endpoint,
              "completion_window": body.completion_window}
    if body.metadata:
        fields["metadata"] = json.dumps(body.metadata)
    tenant = request.get(TENANT)
    if tenant is not None:
        fields["tenant"] = tenant.name  # its lines queue in the tenant's stream, within its limit
    await jobs.create(job_id, fields)
    job = await jobs.get(job_id)
    return web.json_response(job.to_openai())


async def _check_endpoint(content: bytes, endpoint: str) -> None:
    """A file with a line for another endpoint is refused here, as OpenAI does (text that is not
    UTF-8 is the ingester's to refuse, with the job)."""
    try:
        text = content.decode()
    except UnicodeDecodeError:
        return
    mismatch = await asyncio.to_thread(endpoint_mismatch, text, endpoint)  # a big file: off the loop
    if mismatch is not None:
        raise BadRequest(f"the input file's {mismatch.message}", param="input_file_id",
                         code="endpoint_mismatch")


async def retrieve(request: web.Request) -> web.Response:
    return web.json_response((await _job(request)).to_openai())


async def list_batches(request: web.Request) -> web.Response:
    unknown = sorted(set(request.query) - {"limit", "after"})
    if unknown:
        raise BadRequest(f"unsupported query parameter: {unknown[0][:100]!r}", param=unknown[0][:100])
    repeated = next((name for name in request.query if len(request.query.getall(name)) > 1), None)
    if repeated is not None:
        raise BadRequest(f"the query parameter {repeated!r} is given twice", param=repeated)
    after = request.query.get("after")
    if after is not None and not re.match(JOB_ID_PATTERN, after):
        raise BadRequest(f"after must be a batch id, got {after[:100]!r}", param="after")
    try:
        limit = int(request.query.get("limit", "20"))
    except ValueError:
        raise BadRequest("limit must be an integer", param="limit") from None
    if not 1 <= limit <= 100:
        raise BadRequest(f"limit must be between 1 and 100, got {limit}", param="limit")
    jobs, has_more = await _page(request, limit, after)
    data = [job.to_openai() for job in jobs]
    return web.json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None, "has_more": has_more})


async def _page(request: web.Request, limit: int, after: str | None) -> tuple[list[Job], bool]:
    """The caller's jobs, newest first, after the job `after` (an id it cannot see: from the start,
    as an unknown id)."""
    who = caller(request)
    jobs = request.app[JOBS]
    if who.sees_everything:
        return await jobs.list(limit=limit, after=after)
    client = request.app[REDIS]
    start = 0
    if after is not None:
        rank = await client.zrevrank(jobs.keys.batch_jobs, after)
        owner = await client.hget(jobs.keys.batch_job(after), "tenant") if rank is not None else None
        if rank is not None and who.can_see(owner.decode() if owner is not None else None):
            start = rank + 1
    ids = await visible_ids(client, jobs.keys.batch_jobs, jobs.keys.batch_job, who, start=start,
                            count=limit + 1)
    pipe = client.pipeline(transaction=False)
    for job_id in ids[:limit]:
        pipe.hgetall(jobs.keys.batch_job(job_id))
    found = [Job.parse(job_id, raw) for job_id, raw in zip(ids, await pipe.execute(), strict=False)]
    return [job for job in found if job is not None], len(ids) > limit


async def cancel(request: web.Request) -> web.Response:
    job = await _job(request)
    job_id = job.id
    jobs = request.app[JOBS]
    if not await jobs.stop(job_id, "cancelled"):
        job = await jobs.get(job_id)
        if job.ending != "cancelled":
            raise Conflict(f"batch {job_id!r} is {job.status}; only a validating or in-progress batch can be "
                           "cancelled", param="batch_id", code="batch_not_cancellable")
    job = await jobs.get(job_id)
    return web.json_response(job.to_openai())
