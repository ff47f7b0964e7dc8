"""/v1/files: upload a batch job's input (multipart, as the openai client sends it), read files
back, list and delete them. A finished job's results are files too: `file-{job}-output` and
`file-{job}-errors` are read from the job's output stream, not stored twice.

Files live in Redis (`tf:file:{id}`: content, filename, purpose, bytes, created_at), so every
gateway sees every file and an ingester anywhere can read a job's input.
"""

from __future__ import annotations

import re
import time
import uuid

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from gateway.appkeys import JOBS, REDIS, SETTINGS
from gateway.errors import BadRequest, NotFound
from gateway.responses import Shape

FILE_ID_PATTERN = r"^file-[A-Za-z0-9_-]{1,80}$"
_RESULT_FILE = re.compile(r"^file-(.+)-(output|errors)$")
PURPOSES = ("batch",)
_META = (b"bytes", b"created_at", b"filename", b"purpose")  # a file's fields besides its content


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
    pipe = request.app[REDIS].pipeline(transaction=True)
    pipe.hset(keys.file(file_id), mapping={"content": content, "filename": filename, "purpose": purpose,
                                           "bytes": len(content), "created_at": now})
    pipe.zadd(keys.files, {file_id: now})
    await pipe.execute()
    meta = {b"bytes": str(len(content)).encode(), b"created_at": str(now).encode(),
            b"filename": filename.encode(), b"purpose": purpose.encode()}
    return web.json_response(_file_object(file_id, meta))


async def _stored(request: web.Request, file_id: str) -> dict[bytes, bytes]:
    keys = request.app[JOBS].keys
    raw = await request.app[REDIS].hmget(keys.file(file_id), [m.decode() for m in _META])
    if raw[0] is None:
        raise NotFound(f"no file {file_id!r}", param="file_id")
    return dict(zip(_META, raw, strict=True))


async def _result_file(request: web.Request, file_id: str) -> tuple[dict, bytes] | None:
    match = _RESULT_FILE.match(file_id)
    if match is None:
        return None
    job_id, kind = match.groups()
    jobs = request.app[JOBS]
    job = await jobs.get(job_id)
    if job is None:
        return None
    lines = await jobs.outputs(job_id, ok=kind == "output")
    content = "".join(line + "\n" for line in lines).encode()
    meta = {b"bytes": str(len(content)).encode(), b"created_at": job.fields.get("created_at", "0").encode(),
            b"filename": f"{job_id}_{kind}.jsonl".encode(), b"purpose": b"batch_output"}
    return meta, content


async def retrieve(request: web.Request) -> web.Response:
    file_id = _file_id(request)
    result = await _result_file(request, file_id)
    meta = result[0] if result is not None else await _stored(request, file_id)
    return web.json_response(_file_object(file_id, meta))


async def content(request: web.Request) -> web.Response:
    file_id = _file_id(request)
    result = await _result_file(request, file_id)
    if result is not None:
        return web.Response(body=result[1], content_type="application/jsonl")
    data = await request.app[REDIS].hget(request.app[JOBS].keys.file(file_id), "content")
    if data is None:
        raise NotFound(f"no file {file_id!r}", param="file_id")
    return web.Response(body=data, content_type="application/jsonl")


async def list_files(request: web.Request) -> web.Response:
    if request.query:
        name = next(iter(request.query))[:100]
        raise BadRequest(f"unsupported query parameter: {name!r}", param=name)
    keys = request.app[JOBS].keys
    ids = [i.decode() for i in await request.app[REDIS].zrevrange(keys.files, 0, 999)]
    pipe = request.app[REDIS].pipeline(transaction=False)
    for file_id in ids:
        pipe.hmget(keys.file(file_id), [m.decode() for m in _META])
    data = []
    for file_id, row in zip(ids, await pipe.execute(), strict=True):
        if row[0] is not None:
            data.append(_file_object(file_id, dict(zip(_META, row, strict=True))))
    return web.json_response({"object": "list", "data": data, "has_more": False})


async def delete(request: web.Request) -> web.Response:
    file_id = _file_id(request)
    keys = request.app[JOBS].keys
    pipe = request.app[REDIS].pipeline(transaction=True)
    pipe.delete(keys.file(file_id))
    pipe.zrem(keys.files, file_id)
    deleted, _ = await pipe.execute()
    if not deleted:
        raise NotFound(f"no file {file_id!r}", param="file_id")
    return web.json_response({"id": file_id, "object": "file", "deleted": True})
