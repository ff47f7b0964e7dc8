"""/v1/files: upload a batch job's input (multipart, as the openai client sends it), read files
back, list and delete them. A finished job's results are files too: `file-{job}-output` and
`file-{job}-errors` are read from the job's output stream, not stored twice.

Files live in Redis (`tf:file:{id}`: content, filename, purpose, bytes, created_at, and the
tenant whose key uploaded it), so every gateway sees every file and an ingester anywhere can
read a job's input. With tenants, a file is its tenant's (a job's results are the job's
tenant's): another tenant gets a 404 and does not see it listed (gateway/tenants/access.py).
The list holds uploads and the results of finished jobs (`purpose: "batch_output"`), as
OpenAI's does.
"""

from __future__ import annotations

import re
import time
import uuid

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from gateway.api.batch.jobs import JOBS, TERMINAL_JOB_STATES, Job
from gateway.core.appkeys import REDIS, SETTINGS
from gateway.core.shapes import Shape
from gateway.errors import BadRequest, NotFound
from gateway.tenants.access import Caller, caller, visible_ids
from protocol import lua

FILE_ID_PATTERN = r"^file-[A-Za-z0-9_-]{1,80}$"
_RESULT_FILE = re.compile(r"^file-(.+)-(output|errors)$")
PURPOSES = ("batch",)
_META = (b"bytes", b"created_at", b"filename", b"purpose")  # a file's fields besides its content
MAX_LISTED = 1000  # uploads, and jobs whose results are listed
# A finished job's result file never changes: its size is kept in the job's hash (if the hash
# is still there) so that a list does not read every job's output again.
_KEEP_SIZE = lua.Script("keep_size")


class FileObject(Shape):
    id: str
    object: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"


class FileList(Shape):
    object: str
    data: list[FileObject]
    has_more: bool = False


class FileDeleted(Shape):
    id: str
    object: str
    deleted: bool


def _file_object(file_id: str, raw: dict[bytes, bytes]) -> dict:
    return {"id": file_id, "object": "file", "bytes": int(raw.get(b"bytes", 0)),
            "created_at": int(float(raw.get(b"created_at", 0))),
            "filename": raw.get(b"filename", b"").decode(), "purpose": raw.get(b"purpose", b"batch").decode(),
            "status": "processed"}


def _file_id(request: web.Request) -> str:
    file_id = request.match_info["file_id"]
    if not re.match(FILE_ID_PATTERN, file_id):
        raise NotFound(f"no file {file_id[:100]!r}", param="file_id")
    return file_id


async def _read_form(request: web.Request, limit: int) -> tuple[bytes | None, str, str | None]:
    """(file content, filename, purpose) of an upload form."""
    content, filename, purpose = None, "upload.jsonl", None
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if part.name == "purpose":
            purpose = (await part.text()).strip()
        elif part.name == "file":
            filename = part.filename or filename
            chunks, size = [], 0
            while chunk := await part.read_chunk(1 << 20):
                size += len(chunk)
                if size > limit:
                    raise BadRequest(f"the file is larger than this server's limit of {limit} bytes",
                                     param="file", code="file_too_large")
                chunks.append(chunk)
            content = b"".join(chunks)
        else:
            raise BadRequest(f"unsupported form field {part.name!r}", param=part.name)
    return content, filename, purpose


async def upload(request: web.Request) -> web.Response:
    if not request.content_type.startswith("multipart/"):
        raise BadRequest("upload a file as multipart/form-data with the fields 'file' and 'purpose'",
                         param="file", code="invalid_content_type")
    try:
        content, filename, purpose = await _read_form(request, request.app[SETTINGS].max_file_bytes)
    except (ValueError, AssertionError, UnicodeDecodeError, HttpProcessingError) as exc:  # a broken body
        raise BadRequest(f"the multipart body cannot be read: {exc}", param="file",
                         code="invalid_multipart") from None
    if content is None:
        raise BadRequest("missing required parameter: file", param="file")
    if purpose not in PURPOSES:
        raise BadRequest(f"purpose must be one of {list(PURPOSES)}, got {purpose!r}", param="purpose")
    try:
        content.decode()
    except UnicodeDecodeError:
        raise BadRequest("the file is not UTF-8 text (JSONL expected)", param="file") from None
    file_id = f"file-{uuid.uuid4().hex}"
    now = time.time()
    keys = request.app[JOBS].keys
    fields = {"content": content, "filename": filename, "purpose": purpose, "bytes": len(content),
              "created_at": now}
    owner = caller(request).tenant
    if owner is not None:
        fields["tenant"] = owner
    pipe = request.app[REDIS].pipeline(transaction=True)
    pipe.hset(keys.file(file_id), mapping=fields)
    pipe.zadd(keys.files, {file_id: now})
    await pipe.execute()
    meta = {b"bytes": str(len(content)).encode(), b"created_at": str(now).encode(),
            b"filename": filename.encode(), b"purpose": purpose.encode()}
    return web.json_response(_file_object(file_id, meta))


async def stored_file(request: web.Request, file_id: str, param: str = "file_id") -> dict[bytes, bytes]:
    """An uploaded file's description, if the caller may see it (another tenant's: no file)."""
    keys = request.app[JOBS].keys
    raw = await request.app[REDIS].hmget(keys.file(file_id), [*(m.decode() for m in _META), "tenant"])
    owner = raw[-1].decode() if raw[-1] is not None else None
    if raw[0] is None or not caller(request).can_see(owner):
        raise NotFound(f"no file {file_id!r}", param=param)
    return dict(zip(_META, raw[:-1], strict=True))


async def _result_job(request: web.Request, file_id: str) -> tuple[Job, str] | None:
    """(job, "output" | "errors") of a job's result file; None when the id names none. Another
    tenant's job's results are no file to the caller."""
    match = _RESULT_FILE.match(file_id)
    if match is None:
        return None
    job_id, kind = match.groups()
    job = await request.app[JOBS].get(job_id)
    if job is None:
        return None
    if not caller(request).can_see(job.tenant):
        raise NotFound(f"no file {file_id!r}", param="file_id")
    return job, kind


def _size_field(kind: str) -> str:
    return f"{kind}_file_bytes"


async def _result_content(request: web.Request, job: Job, kind: str) -> bytes:
    lines = await request.app[JOBS].outputs(job.id, ok=kind == "output")
    content = "".join(line + "\n" for line in lines).encode()
    if job.status in TERMINAL_JOB_STATES:  # final: keep its size for the list
        job_key = request.app[JOBS].keys.batch_job(job.id)
        await _KEEP_SIZE.run_async(request.app[REDIS], [job_key], [_size_field(kind), len(content)])
    return content


def _result_time(job: Job) -> float:
    """When the result file came to be: the job's end (its creation while it runs)."""
    return float(job.fields.get(f"{job.status}_at") or job.fields.get("created_at") or 0)


def _result_meta(job: Job, kind: str, num_bytes: int) -> dict[bytes, bytes]:
    return {b"bytes": str(num_bytes).encode(), b"created_at": str(_result_time(job)).encode(),
            b"filename": f"{job.id}_{kind}.jsonl".encode(), b"purpose": b"batch_output"}


async def retrieve(request: web.Request) -> web.Response:
    file_id = _file_id(request)
    result = await _result_job(request, file_id)
    if result is None:
        return web.json_response(_file_object(file_id, await stored_file(request, file_id)))
    job, kind = result
    size = job.fields.get(_size_field(kind))
    num_bytes = int(size) if size is not None else len(await _result_content(request, job, kind))
    return web.json_response(_file_object(file_id, _result_meta(job, kind, num_bytes)))


async def content(request: web.Request) -> web.Response:
    file_id = _file_id(request)
    result = await _result_job(request, file_id)
    if result is not None:
        return web.Response(body=await _result_content(request, *result), content_type="application/jsonl")
    await stored_file(request, file_id)  # one the caller may read
    data = await request.app[REDIS].hget(request.app[JOBS].keys.file(file_id), "content")
    if data is None:  # deleted meanwhile
        raise NotFound(f"no file {file_id!r}", param="file_id")
    return web.Response(body=data, content_type="application/jsonl")


async def _uploads(request: web.Request, who: Caller) -> list[tuple[float, dict]]:
    keys = request.app[JOBS].keys
    client = request.app[REDIS]
    ids = await visible_ids(client, keys.files, keys.file, who, count=MAX_LISTED)
    pipe = client.pipeline(transaction=False)
    for file_id in ids:
        pipe.hmget(keys.file(file_id), [m.decode() for m in _META])
    found = []
    for file_id, row in zip(ids, await pipe.execute(), strict=True):
        if row[0] is not None:
            found.append((float(row[1] or 0), _file_object(file_id, dict(zip(_META, row, strict=True)))))
    return found


async def _results(request: web.Request, who: Caller) -> list[tuple[float, dict]]:
    """The result files of the caller's finished jobs, as the Batch objects name them."""
    jobs = request.app[JOBS]
    client = request.app[REDIS]
    ids = await visible_ids(client, jobs.keys.batch_jobs, jobs.keys.batch_job, who, count=MAX_LISTED)
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        pipe.hgetall(jobs.keys.batch_job(job_id))
    found = []
    for job_id, raw in zip(ids, await pipe.execute(), strict=True):
        job = Job.parse(job_id, raw)
        if job is None:
            continue
        batch = job.to_openai()
        for file_id, kind in ((batch["output_file_id"], "output"), (batch["error_file_id"], "errors")):
            if file_id is None:
                continue
            size = job.fields.get(_size_field(kind))
            num_bytes = int(size) if size is not None else len(await _result_content(request, job, kind))
            found.append((_result_time(job), _file_object(file_id, _result_meta(job, kind, num_bytes))))
    return found


async def list_files(request: web.Request) -> web.Response:
    """Uploads and finished jobs' results, newest first."""
    if request.query:
        name = next(iter(request.query))[:100]
        raise BadRequest(f"unsupported query parameter: {name!r}", param=name)
    who = caller(request)
    found = await _uploads(request, who) + await _results(request, who)
    found.sort(key=lambda item: item[0], reverse=True)
    return web.json_response({"object": "list", "data": [f for _, f in found], "has_more": False})


async def delete(request: web.Request) -> web.Response:
    file_id = _file_id(request)
    await stored_file(request, file_id)  # another tenant's is no file to delete
    keys = request.app[JOBS].keys
    pipe = request.app[REDIS].pipeline(transaction=True)
    pipe.delete(keys.file(file_id))
    pipe.zrem(keys.files, file_id)
    deleted, _ = await pipe.execute()
    if not deleted:
        raise NotFound(f"no file {file_id!r}", param="file_id")
    return web.json_response({"id": file_id, "object": "file", "deleted": True})
