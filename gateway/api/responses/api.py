"""The Responses API: POST /v1/responses, GET / DELETE /v1/responses/{id} (GET resumes the
event stream with ?stream=true&starting_after=N), POST /v1/responses/{id}/cancel, and
GET /v1/responses/{id}/input_items.

A response is one queued chat request (gateway/api/responses/translate.py) whose id is the
response's (`resp_<req_id>`). A stored response keeps its spec beside the request's record;
its object and its events are rebuilt from the two by whichever gateway is asked, so a
`background` response needs no gateway at all while it runs: a scheduler that dies hands it to
another (the fleet's takeover), a gateway that dies loses nothing.
"""

from __future__ import annotations

import asyncio
import re
import time

from aiohttp import web

from gateway.api.openai.params import plan_chat
from gateway.api.responses.events import Pieces, ResponseEvents
from gateway.api.responses.objects import RESPONSE_PREFIX, Outcome, output_items, response_id, response_object
from gateway.api.responses.schemas import ResponseCreate
from gateway.api.responses.store import ResponseStore
from gateway.api.responses.translate import chat_request, normalize_input, renamed
from gateway.core.appkeys import SETTINGS
from gateway.errors import BadRequest, GatewayError, NotFound, UpstreamFailed
from gateway.fleet.queue_times import QUEUE_TIMES
from gateway.serving.follow import Watch
from gateway.serving.handlers import (
    ClientGone,
    EventStream,
    admit,
    admit_tenant,
    client_gone,
    following,
    new_req_id,
    read_body,
    submissions,
    tenant_leases,
)
from gateway.serving.plan import Plan
from gateway.serving.sse import frame
from gateway.serving.store import STORE, Submission
from gateway.tenants.access import caller
from gateway.tenants.directory import Tenant
from gateway.tenants.limits import LIMITER
from gateway.tokens.models import MODELS, ServedModel
from gateway.tokens.tokenize_pool import TOKENIZE
from protocol.result_record import ErrorCode

_ID = re.compile(r"^resp_([0-9a-f]{32})$")
MAX_LIST_LIMIT = 100


def _responses(request: web.Request) -> ResponseStore:
    store = request.app[STORE]
    return ResponseStore(store.client, store.keys, store.result_ttl_s)


def _plan(chat, model: ServedModel, settings) -> Plan:
    try:
        return plan_chat(chat, model, settings)
    except GatewayError as exc:
        raise renamed(exc) from None


async def _load(request: web.Request, response_id_: str, *, param: str | None = None) -> tuple[str, dict]:
    """(req_id, spec) of a stored response the caller may see; 404 otherwise (another tenant's
    is as unknown as one that never was)."""
    match = _ID.match(response_id_)
    found = await _responses(request).load(match.group(1)) if match else None
    if found is None or not caller(request).can_see(found[1]):
        raise NotFound(f"no response {response_id_!r} (unknown, deleted, or expired)", param=param,
                       code="response_not_found")
    return match.group(1), found[0]


async def _outcome(request: web.Request, req_id: str) -> Outcome:
    record = await request.app[STORE].read(req_id)
    if record is None:  # expired with its record, or never queued (its gateway died first)
        return Outcome("failed", error={"message": "the response's request is gone (never queued, or its "
                                        "record expired)"})
    return Outcome.of_record(record)


async def _context(request: web.Request, previous_id: str) -> list[dict]:
    """What a response chained after `previous_id` sees before its own input: the previous
    one's context, its input and its output."""
    req_id, spec = await _load(request, previous_id, param="previous_response_id")
    outcome = await _outcome(request, req_id)
    if not outcome.is_terminal:
        raise BadRequest(f"response {previous_id!r} is still {outcome.state}: chain after it once it ended",
                         param="previous_response_id")
    return spec["context_items"] + spec["input_items"] + output_items(spec, outcome)


def _spec(body: ResponseCreate, req_id: str, plan: Plan, context: list[dict], items: list[dict]) -> dict:
    tools = [{"type": "function", "name": tool["name"], "description": tool.get("description"),
              "parameters": tool.get("parameters"), "strict": tool.get("strict", True)}
             for tool in body.tools or []]
    return {
        "id": response_id(req_id), "req_id": req_id, "created_at": int(time.time()), "model": plan.model.name,
        "instructions": body.instructions, "tools": tools, "tool_choice": body.tool_choice or "auto",
        "asked_parallel": body.parallel_tool_calls is not False,
        "text": {"format": (body.text.format if body.text else None) or {"type": "text"}},
        "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "previous_response_id": body.previous_response_id, "metadata": body.metadata or {},
        "background": body.background, "store": body.store, "user": body.user,
        # how the output is read back (as the chat path reads it)
        "call_format": plan.tool_format, "parallel_calls": plan.parallel_tool_calls,
        "forced": plan.is_tool_choice_forced,
        "context_items": context, "input_items": items,
    }


async def create(request: web.Request) -> web.StreamResponse:
    body, _ = await read_body(request, ResponseCreate)
    model = request.app[MODELS].get(body.model)
    req_id = new_req_id()
    context = await _context(request, body.previous_response_id) if body.previous_response_id else []
    items = normalize_input(body.input, req_id)
    chat = chat_request(body, context + items)
    plan = await request.app[TOKENIZE].run(_plan, chat, model, request.app[SETTINGS])
    spec = _spec(body, req_id, plan, context, items)
    await admit(request, plan.model.name, 1)
    tenant = await admit_tenant(request, plan, [req_id])
    if body.store:  # before the request exists: whoever sees the request finds its response
        try:
            await _responses(request).save(spec, tenant.name if tenant is not None else None)
        except BaseException:
            if tenant is not None:
                await asyncio.shield(request.app[LIMITER].release(tenant.name, [req_id]))
            raise
    lease_until = request.app[LIMITER].lease_for_queue(tenant) if tenant is not None else None
    queued = submissions(plan, [req_id], tenant=tenant, lease_until=lease_until)
    if body.background and not body.stream:
        await _submit_background(request, queued, tenant)
        return web.json_response(response_object(spec, Outcome("queued")))
    # A background response's stream may go: the response runs on (resume it with GET).
    leases = tenant_leases(request, None if body.background else tenant, [req_id])
    follow = following(request, plan.model, [req_id], cancel_unfinished=not body.background)
    async with leases, follow as watch:
        if body.background:
            await _submit_background(request, queued, tenant)
        else:
            await request.app[STORE].submit(queued)
        if body.stream:
            response = await _stream(request, spec, plan.model, watch)
        else:
            response = await _collect(request, spec, watch)
    request.app[QUEUE_TIMES].add(plan.model.name, [req_id])  # (read once it started: its queue time)
    return response


async def _submit_background(request: web.Request, queued: list[Submission], tenant: Tenant | None) -> None:
    """No call waits for a background response: its tenant lease lasts until the scheduler
    writes its end, or ends here if it was never queued."""
    try:
        await request.app[STORE].submit(queued)
    except BaseException:
        if tenant is not None:
            await asyncio.shield(request.app[LIMITER].release(tenant.name, [sub.req_id for sub in queued]))
        raise


async def _collect(request: web.Request, spec: dict, watch: Watch) -> web.Response:
    async for batch in watch.batches():
        if not batch and client_gone(request):
            raise ClientGone()
    outcome = await _outcome(request, spec["req_id"])
    if outcome.state in ("failed", "expired"):
        error = outcome.error or {}
        message = error.get("message", "the request failed")
        if error.get("code") == ErrorCode.INVALID_REQUEST:  # the scheduler refused the input itself
            raise BadRequest(message, code="invalid_request")
        raise UpstreamFailed(message, code=error.get("code", "request_failed"))
    return web.json_response(response_object(spec, outcome))


async def _stream(request: web.Request, spec: dict, model: ServedModel, watch: Watch, *,
                  starting_after: int = -1, catch_up: bool = False) -> web.StreamResponse:
    """The response's events after `starting_after`; with catch_up, first those the record
    holds already (a resumed stream)."""
    store = request.app[STORE]
    req_id = spec["req_id"]
    events = ResponseEvents(spec)
    pieces = Pieces(lambda: store.read(req_id), model.decode)

    async def of(delta) -> list[dict]:
        out = []
        for piece in await pieces.of(delta):
            out += events.piece(piece)
        if delta.is_final:
            out += events.final(await _outcome(request, req_id))
        return out

    def frames(batch: list[dict]) -> bytes:
        return b"".join(frame(event, event=event["type"]) for event in batch
                        if event["sequence_number"] > starting_after)

    stream = EventStream(request)
    await stream.open()
    keepalive_s = request.app[SETTINGS].keepalive_s
    try:
        first = events.opening()
        if catch_up:
            for _, delta in await watch.catch_up():
                first += await of(delta)
        if frames(first):
            await stream.write(frames(first))
        async for batch in watch.batches():
            if not batch:  # a quiet tick
                await stream.keep_alive(keepalive_s)
                continue
            out = []
            for _, delta in batch:
                out += await of(delta)
            data = frames(out)
            if data:
                await stream.write(data)
    except ConnectionError:
        pass  # the client left: following() cancels the response unless it runs in the background
    finally:
        await stream.close()
    return stream.response


def _starting_after(request: web.Request) -> int:
    raw = request.query.get("starting_after", "-1").strip()
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"starting_after must be a sequence number, got {raw!r}",
                         param="starting_after") from None


async def retrieve(request: web.Request) -> web.StreamResponse:
    req_id, spec = await _load(request, request.match_info["response_id"])
    stream = request.query.get("stream", "false").lower()
    if stream not in ("true", "false"):
        raise BadRequest("stream must be true or false", param="stream")
    if stream == "false":
        if "starting_after" in request.query:
            raise BadRequest("starting_after needs stream=true", param="starting_after")
        return web.json_response(response_object(spec, await _outcome(request, req_id)))
    after = _starting_after(request)
    model = request.app[MODELS].get(spec["model"])
    async with following(request, model, [req_id], cancel_unfinished=False) as watch:
        # Subscribed first, then the record: whatever the record lacks arrives as events.
        return await _stream(request, spec, model, watch, starting_after=after, catch_up=True)


async def cancel(request: web.Request) -> web.Response:
    """Cancel a background response (a no-op on one that ended); answers it as it stands
    within cancel_wait_s."""
    req_id, spec = await _load(request, request.match_info["response_id"])
    if not spec["background"]:
        raise BadRequest("only background responses can be cancelled (a streamed or waited-for one ends "
                         "when its client disconnects)", param="response_id")
    store = request.app[STORE]
    record = await store.read(req_id)
    if record is not None and not record.is_terminal:
        if not await store.finish_unclaimed(record, "cancelled", "cancelled by the client"):
            await store.cancel([req_id])
        deadline = time.monotonic() + request.app[SETTINGS].cancel_wait_s
        while not record.is_terminal and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            record = await store.read(req_id) or record
    return web.json_response(response_object(spec, await _outcome(request, req_id)))


async def delete(request: web.Request) -> web.Response:
    """Forget a stored response (a running one is cancelled: nobody could read it any more)."""
    response_id_ = request.match_info["response_id"]
    req_id, _ = await _load(request, response_id_)
    store = request.app[STORE]
    record = await store.read(req_id)
    if record is not None and not record.is_terminal \
            and not await store.finish_unclaimed(record, "cancelled", "the response was deleted"):
        await store.cancel([req_id])
    await _responses(request).delete(req_id)
    return web.json_response({"id": response_id_, "object": "response.deleted", "deleted": True})


def _limit(request: web.Request) -> int:
    raw = request.query.get("limit", "20")
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise BadRequest(f"limit must be 1 to {MAX_LIST_LIMIT}, got {raw!r}", param="limit")
    return int(raw)


async def input_items(request: web.Request) -> web.Response:
    """Every item the model was given (a chained response's context first), newest first unless
    order=asc; paged by `after` (an item id) and `limit`."""
    _, spec = await _load(request, request.match_info["response_id"])
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("order must be asc or desc", param="order")
    for name in request.query:
        if name not in ("order", "limit", "after", "include"):
            raise BadRequest(f"unsupported parameter: {name}", param=name)
    if request.query.getall("include", []):
        raise BadRequest("include is not supported on input_items", param="include")
    items = spec["context_items"] + spec["input_items"]
    if order == "desc":
        items = items[::-1]
    if "after" in request.query:
        ids = [item["id"] for item in items]
        if request.query["after"] not in ids:
            raise BadRequest(f"no item {request.query['after']!r} in this response's input", param="after")
        items = items[ids.index(request.query["after"]) + 1:]
    limit = _limit(request)
    page = items[:limit]
    return web.json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


__all__ = ["RESPONSE_PREFIX", "cancel", "create", "delete", "input_items", "retrieve"]
