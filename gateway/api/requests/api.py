"""Submit-and-poll: POST /v1/requests, GET / DELETE /v1/requests/{id}, and the resumable
event stream GET /v1/requests/{id}/events (SSE with `id: <seq>`, Last-Event-ID)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time

from aiohttp import web
from pydantic import TypeAdapter

from gateway.api.embeddings.api import embedding_submissions, queued_plan
from gateway.api.embeddings.format import embedding_list
from gateway.api.embeddings.plan import EmbeddingPlan, plan_embeddings
from gateway.api.models.adapters import resolve_model
from gateway.api.openai.format import (
    ChoiceOutput,
    cached_tokens_of,
    chat_completion,
    chat_logprobs,
    text_completion,
)
from gateway.api.openai.params import plan_chat, plan_completion
from gateway.api.requests.schemas import SubmitChat, SubmitEmbedding, SubmitRequest
from gateway.core.appkeys import API_KEY, SETTINGS
from gateway.errors import BadRequest, Conflict, NotFound
from gateway.serving.follow import EXPIRED_MESSAGE
from gateway.serving.handlers import (
    EventStream,
    admit,
    admit_tenant,
    following,
    read_body,
    submissions,
)
from gateway.serving.plan import ChoicePlan, Plan
from gateway.serving.records import Delta, ResultRecord
from gateway.serving.sse import Template, dumps, encode_basestring, frame
from gateway.serving.store import STORE
from gateway.tenants.access import caller
from gateway.tenants.limits import LIMITER
from gateway.tokens.models import MODELS, ServedModel
from gateway.tokens.tokenize_pool import TOKENIZE

SUBMIT = TypeAdapter(SubmitRequest)
_REQ_ID = re.compile(r"^[0-9a-f]{32}$")
MAX_IDEMPOTENCY_KEY = 255


def _plan(request: web.Request, body: SubmitChat | object,
          model: ServedModel) -> tuple[Plan | EmbeddingPlan, float | None]:
    settings = request.app[SETTINGS]
    if body.deadline is not None and body.timeout is not None:
        raise BadRequest("give deadline or timeout, not both", param="timeout")
    deadline = body.deadline if body.timeout is None else time.time() + body.timeout
    if isinstance(body, SubmitEmbedding):
        plan = plan_embeddings(body, model)
        if len(plan.prompts) != 1:
            raise BadRequest("one input per request on /v1/requests", param="input")
        return plan, deadline
    for name, ok in (("stream", not body.stream), ("n", body.n == 1)):
        if not ok:
            raise BadRequest(f"{name} is not available on /v1/requests (one request per id; stream its "
                             "tokens with GET /v1/requests/{id}/events)", param=name)
    if isinstance(body, SubmitChat):
        plan = plan_chat(body, model, settings)
    else:
        plan = plan_completion(body, model, settings)
        if len(plan.choices) != 1:
            raise BadRequest("one prompt per request on /v1/requests", param="prompt")
    return plan, deadline


def _links(req_id: str) -> dict:
    return {"self": f"/v1/requests/{req_id}", "events": f"/v1/requests/{req_id}/events"}


async def submit(request: web.Request) -> web.Response:
    """202 + Location. With an Idempotency-Key, a retry (even one that would now be refused
    for a full queue) answers the request the first attempt created."""
    body, raw = await read_body(request, SUBMIT)
    model, lora_name = await resolve_model(request, body.model)
    plan, deadline = await request.app[TOKENIZE].run(_plan, request, body, model)  # tokenizes: off the loop
    is_embedding = isinstance(plan, EmbeddingPlan)
    if is_embedding and lora_name is not None:
        raise BadRequest(f"{lora_name!r} is a LoRA adapter; adapters do not serve embeddings", param="model")
    plan.lora_name = lora_name
    store = request.app[STORE]
    idempotency = None
    if "Idempotency-Key" in request.headers:
        idem_key = request.headers["Idempotency-Key"]
        if not 0 < len(idem_key) <= MAX_IDEMPOTENCY_KEY:
            raise BadRequest(f"Idempotency-Key must have 1 to {MAX_IDEMPOTENCY_KEY} characters",
                             param="Idempotency-Key")
        fingerprint = hashlib.sha256(json.dumps(json.loads(raw), sort_keys=True).encode()).hexdigest()
        idempotency = (store.idempotency_key(request.get(API_KEY), idem_key), fingerprint)
        existing = await store.find_idempotency(idempotency[0])
        if existing is not None:
            return await _replay(request, plan, existing, fingerprint)
    # (in its Idempotency-Key's partition: one script writes both, on one slot)
    req_id = store.keys.request_id(idempotency[0] if idempotency is not None else None)
    await admit(request, plan.model.name, 1, runner="pooling" if is_embedding else "generate")
    if is_embedding:  # (its prompt is all it is charged)
        tenant = await admit_tenant(request, queued_plan(plan), [req_id], output_tokens=0)
    else:
        tenant = await admit_tenant(request, plan, [req_id])
    # No call waits for it: its lease lasts until the scheduler writes its end (or it lapses).
    lease_until = request.app[LIMITER].lease_for_queue(tenant) if tenant is not None else None
    if is_embedding:
        (submission,) = embedding_submissions(plan, [req_id], tenant=tenant, lease_until=lease_until,
                                              deadline=deadline)
    else:
        (submission,) = submissions(plan, [req_id], deadline, tenant=tenant, lease_until=lease_until)
    if idempotency is not None:  # taken in the same script that queues it: never one without the other
        submission.idempotency_key, submission.fingerprint = idempotency
    try:
        (existing,) = await store.submit([submission])
    except BaseException:
        if tenant is not None:
            await asyncio.shield(request.app[LIMITER].release(tenant.name, [req_id]))
        raise
    if existing is not None:  # a concurrent retry got there first
        if tenant is not None:
            await request.app[LIMITER].release(tenant.name, [req_id])
        return await _replay(request, plan, existing, idempotency[1])
    created = int(submission.message.arrival_time)  # the record's queued_at: what every later answer says
    return web.json_response(_queued_view(req_id, plan, created, deadline), status=202,
                             headers={"Location": _links(req_id)["self"]})


async def _replay(request: web.Request, plan: Plan, existing: dict, fingerprint: str) -> web.Response:
    if existing["fingerprint"] != fingerprint:
        raise Conflict("this Idempotency-Key was used with another body", param="Idempotency-Key",
                       code="idempotency_key_reused")
    record = await request.app[STORE].read(existing["id"])
    # (No record: it expired; the key outlived it. Its `created` is gone with it.)
    view = _view(record, plan.model) if record is not None else _queued_view(existing["id"], plan, None)
    return web.json_response(view, status=202, headers={"Location": _links(existing["id"])["self"],
                                                        "Idempotent-Replayed": "true"})


def _created(queued_at: float | None) -> int | None:
    """Integer seconds, as OpenAI's `created`: the submit time stored once in the record."""
    return int(queued_at) if queued_at is not None else None


def _queued_view(req_id: str, plan: Plan, created: int | None, deadline: float | None = None) -> dict:
    return {"id": req_id, "object": "request", "kind": plan.api, "model": plan.model.name, "status": "queued",
            "created": created, "deadline": deadline, "links": _links(req_id)}


async def _record(request: web.Request) -> tuple[str, ResultRecord, ServedModel]:
    req_id = request.match_info["req_id"]
    record = await request.app[STORE].read(req_id) if _REQ_ID.match(req_id) else None
    if record is not None and not caller(request).can_see(record.tenant):
        record = None  # another tenant's: the same 404 as an unknown id, so nothing says it exists
    if record is None:
        raise NotFound(f"no request {req_id!r} (unknown, or its record expired)", code="request_not_found")
    try:
        model = request.app[MODELS].get(record.model)
    except NotFound:
        raise NotFound(f"request {req_id!r} is for a model this gateway does not front",
                       code="request_not_found") from None
    return req_id, record, model


def _timings(record: ResultRecord) -> dict:
    def since(a: float | None, b: float | None) -> float | None:
        return round(b - a, 6) if a is not None and b is not None else None

    return {"queued_at": record.queued_at, "started_at": record.started_at,
            "first_token_at": record.first_token_at, "finished_at": record.finished_at,
            "queue_s": since(record.queued_at, record.started_at),
            "time_to_first_token_s": since(record.queued_at, record.first_token_at),
            "total_s": since(record.queued_at, record.finished_at)}


def _result(record: ResultRecord, model: ServedModel) -> dict | None:
    """The finished request in the shape its OpenAI endpoint would have answered."""
    if record.state != "completed":
        return None
    if record.api == "embedding":  # as /v1/embeddings answers it (floats, its default)
        return embedding_list(record.model, [record.embedding or ""], "float", record.prompt_tokens)
    echo_text, is_prompt_only = record.echo if record.echo is not None else ("", False)
    plan = Plan(record.api or "completion", model, [ChoicePlan(0, 0, [], None)], [echo_text],
                [record.prompt_tokens], logprobs=record.top_logprobs,
                created=_created(record.queued_at) or int(time.time()),
                tool_format=record.tool_format, parallel_tool_calls=record.parallel_tool_calls,
                echo=record.echo is not None, is_prompt_only=is_prompt_only,
                prompt_logprobs=record.prompt_top_logprobs)
    out = ChoiceOutput(0, record.text, len(record.token_ids), record.logprobs or [], record.finish_reason,
                       state=record.state, cached_tokens=cached_tokens_of(record.usage),
                       prompt_logprobs=record.prompt_logprobs)
    if plan.api == "chat":
        return chat_completion(plan, "chatcmpl-" + record.req_id, [out])
    return text_completion(plan, "cmpl-" + record.req_id, [out])


def _view(record: ResultRecord, model: ServedModel) -> dict:
    output = {"text": record.text, "num_tokens": len(record.token_ids), "finish_reason": record.finish_reason}
    usage = record.final_usage() if record.is_terminal else None
    if record.echo is not None and record.echo[1]:  # max_tokens 0: the token made to score the prompt
        # is not the client's
        output = {"text": "", "num_tokens": 0, "finish_reason": "length" if record.is_terminal else None}
        usage = usage and {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}
    return {
        "id": record.req_id, "object": "request", "kind": record.api, "model": record.model,
        "status": record.state, "created": _created(record.queued_at), "deadline": record.deadline,
        "output": output, "usage": usage,
        "error": record.error, "timings": _timings(record), "last_event_id": record.seq,
        "result": _result(record, model), "links": _links(record.req_id),
    }


async def get_request(request: web.Request) -> web.Response:
    _, record, model = await _record(request)
    if record.state == "queued" and record.owner is None and record.deadline is not None \
            and time.time() > record.deadline:
        await request.app[STORE].finish_unclaimed(record, "expired", EXPIRED_MESSAGE)
        record = await request.app[STORE].read(record.req_id) or record
    return web.json_response(_view(record, model))


async def cancel_request(request: web.Request) -> web.Response:
    """Cancel (a no-op on an ended request); answers the state reached within cancel_wait_s."""
    req_id, record, model = await _record(request)
    store = request.app[STORE]
    if not record.is_terminal:
        if not await store.finish_unclaimed(record, "cancelled", "cancelled by the client"):
            await store.cancel([req_id])
        deadline = time.monotonic() + request.app[SETTINGS].cancel_wait_s
        while True:
            record = await store.read(req_id) or record
            if record.is_terminal or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
    return web.json_response(_view(record, model))


def _last_event_id(request: web.Request) -> int:
    raw = request.headers.get("Last-Event-ID", request.query.get("last_event_id", "0")).strip() or "0"
    if not raw.isdigit():
        raise BadRequest(f"Last-Event-ID must be a sequence number, got {raw!r}", param="Last-Event-ID")
    return int(raw)


async def events(request: web.Request) -> web.StreamResponse:
    """`id: <seq>` on every event; resumes after Last-Event-ID with nothing repeated or missing."""
    after = _last_event_id(request)
    req_id, record, model = await _record(request)  # 404 before any stream starts
    frames = EventFrames(req_id, model, record.top_logprobs or 0)
    stream = EventStream(request)
    keepalive_s = request.app[SETTINGS].keepalive_s
    async with following(request, model, [req_id], after_seq=after, cancel_unfinished=False) as watch:
        # Subscribed first, then the record: whatever the record lacks arrives as events.
        catch_up = await watch.catch_up()
        await stream.open()
        try:
            if catch_up:
                await stream.write(b"".join(frames.of(delta) for _, delta in catch_up))
            async for batch in watch.batches():
                if not batch:  # a quiet tick
                    await stream.keep_alive(keepalive_s)
                    continue
                await stream.write(b"".join(frames.of(delta) for _, delta in batch))
            await stream.send("[DONE]", event="done")
        except ConnectionError:
            pass  # the client left: the request runs on (re-attach with Last-Event-ID)
        finally:
            await stream.close()
    return stream.response


def _kind(delta: Delta) -> str:
    return "error" if delta.error is not None and delta.finish_reason is None else "token"


def _event_data(req_id: str, delta: Delta, model: ServedModel, top_n: int) -> dict:
    data = {"id": req_id, "seq": delta.seq, "text": delta.text, "token_ids": delta.token_ids,
            "finish_reason": delta.finish_reason, "status": delta.state, "usage": delta.usage}
    if delta.logprobs:
        data["logprobs"] = chat_logprobs(model, delta.logprobs, top_n)
    if delta.error is not None:
        data["error"] = delta.error
    return data


class EventFrames:
    """The SSE frames of one request's events: `id: <seq>`, `event: token|error`, the data.
    A plain delta (not the last, no logprobs) comes from a template of the same data."""

    def __init__(self, req_id: str, model: ServedModel, top_n: int) -> None:
        self.req_id = req_id
        self.model = model
        self.top_n = top_n
        self._plain = Template.make(
            lambda seq, text, ids: frame(_event_data(req_id, Delta(0, [], ""), model, top_n)
                                         | {"seq": seq, "text": text, "token_ids": ids}), 3)

    def of(self, delta: Delta) -> bytes:
        if self._plain is not None and delta.state is None and not delta.logprobs and delta.error is None:
            return b"id: %d\nevent: token\n" % delta.seq + self._plain.fill(
                str(delta.seq), encode_basestring(delta.text), dumps(delta.token_ids))
        return frame(_event_data(self.req_id, delta, self.model, self.top_n), event_id=delta.seq,
                     event=_kind(delta))
