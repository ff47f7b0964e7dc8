"""POST /v1/chat/completions and /v1/completions: one queued request per choice, answered
as one JSON object or as SSE chunks ending with `data: [DONE]`."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from gateway.api.models.adapters import resolve_model
from gateway.api.openai.format import ChoiceOutput, ChunkMaker, chat_completion, text_completion
from gateway.api.openai.params import plan_chat, plan_completion
from gateway.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.core.appkeys import METRICS, SETTINGS
from gateway.core.metrics import GatewayMetrics
from gateway.errors import BadRequest, RateLimited, Unavailable, UpstreamFailed
from gateway.fleet.queue_times import QUEUE_TIMES
from gateway.serving.follow import Watch
from gateway.serving.handlers import (
    ClientGone,
    EventStream,
    admit,
    admit_tenant,
    charged_output_tokens,
    client_gone,
    following,
    new_req_id,
    read_body,
    submissions,
    tenant_leases,
)
from gateway.serving.plan import Plan
from gateway.serving.sse import frame
from gateway.serving.store import STORE
from gateway.tenants.limits import LIMITER
from gateway.tokens.tokenize_pool import TOKENIZE
from protocol.result_record import ErrorCode

# The ids of a call's requests, one per choice in choice order: what GET /v1/requests/{id}
# (and its /events, resumable with Last-Event-ID) takes. X-Request-Id is the HTTP call's id.
REQUEST_IDS_HEADER = "tokenfleet-request-id"


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body, _ = await read_body(request, ChatCompletionRequest)
    model, lora_name = await resolve_model(request, body.model)
    plan = await request.app[TOKENIZE].run(plan_chat, body, model, request.app[SETTINGS])
    plan.lora_name = lora_name
    return await _serve(request, plan, "chatcmpl-")


async def completions(request: web.Request) -> web.StreamResponse:
    body, _ = await read_body(request, CompletionRequest)
    model, lora_name = await resolve_model(request, body.model)
    plan = await request.app[TOKENIZE].run(plan_completion, body, model, request.app[SETTINGS])
    plan.lora_name = lora_name
    return await _serve(request, plan, "cmpl-")


class _Timer:
    """Latency metrics of one call, observed as its tokens leave, and the end of each of its
    choices, counted once in tokenfleet_gateway_requests_total{status} however the call ends:
    the request's own end state (completed, failed, expired, cancelled), `disconnected` when
    the client left first (the gateway cancels it then), `rejected` when it was never queued."""

    def __init__(self, metrics: GatewayMetrics, model: str, num_choices: int, started: float) -> None:
        self.metrics = metrics
        self.model = model
        self.started = started
        self.first_token_at: float | None = None
        self.last_token_at: list[float | None] = [None] * num_choices  # choice -> last delivery
        self._itl = metrics.itl.labels(model)  # looked up once, observed per token
        self.num_choices = num_choices
        self.outputs: list[ChoiceOutput] = []  # the choices followed so far
        self.is_client_gone = False
        self._is_counted = False

    def tokens(self, index: int, num_tokens: int, now: float) -> None:
        if not num_tokens:
            return
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.ttft.labels(self.model).observe(now - self.started)
        last = self.last_token_at[index]
        if last is not None:
            self._itl.observe((now - last) / num_tokens)
        self.last_token_at[index] = now

    def finished(self, outputs: list[ChoiceOutput]) -> None:
        self.metrics.e2e.labels(self.model).observe(time.monotonic() - self.started)
        self.outputs = outputs
        self.count_ends("unknown")

    def count_ends(self, unended: str) -> None:
        """Count each choice's end once: its state, or `unended` for one that has none."""
        if self._is_counted:
            return
        self._is_counted = True
        states = [out.state for out in self.outputs] or [None] * self.num_choices
        for state in states:
            self.metrics.requests.labels(self.model, state or unended).inc()


async def _serve(request: web.Request, plan: Plan, id_prefix: str) -> web.StreamResponse:
    started = time.monotonic()
    timer = _Timer(request.app[METRICS], plan.model.name, len(plan.choices), started)
    try:
        await admit(request, plan.model.name, len(plan.choices))
        req_ids = [new_req_id() for _ in plan.choices]
        charged = charged_output_tokens(plan, settles=True)
        tenant = await admit_tenant(request, plan, req_ids, charged)
    except (RateLimited, Unavailable):
        timer.count_ends("rejected")
        raise
    lease_until = request.app[LIMITER].lease_for_queue(tenant) if tenant is not None else None
    response_id = id_prefix + req_ids[0]
    try:
        async with tenant_leases(request, tenant, req_ids), following(request, plan.model, req_ids) as watch:
            queued = submissions(plan, req_ids, tenant=tenant, lease_until=lease_until)
            await request.app[STORE].submit(queued)
            if plan.stream:
                response = await _stream(request, plan, response_id, watch, timer, req_ids)
            else:
                response = await _collect(request, plan, response_id, watch, timer, req_ids)
    finally:  # a call that did not see all its choices end: its client left, or it broke
        timer.count_ends("disconnected" if timer.is_client_gone or client_gone(request) else "failed")
        if tenant is not None and not plan.max_tokens_given:  # charged an estimate: settle on what it used
            used = sum(out.num_tokens for out in timer.outputs)
            await asyncio.shield(request.app[LIMITER].settle(tenant, used - charged))
    request.app[QUEUE_TIMES].add(plan.model.name, req_ids)
    return response


def _raise_for(outputs: list[ChoiceOutput]) -> None:
    """A request that failed in the fleet (not one that was cancelled) fails the call."""
    for out in outputs:
        if out.state in ("failed", "expired") and out.error is not None:
            message = out.error.get("message", "the request failed")
            if out.error.get("code") == ErrorCode.INVALID_REQUEST:  # the scheduler refused the input itself
                raise BadRequest(message, code="invalid_request")
            raise UpstreamFailed(message, code=out.error.get("code", "request_failed"))


async def _collect(request: web.Request, plan: Plan, response_id: str, watch: Watch, timer: _Timer,
                   req_ids: list[str]) -> web.StreamResponse:
    outputs = timer.outputs = [ChoiceOutput(choice.index) for choice in plan.choices]
    async for batch in watch.batches():
        if not batch:  # a quiet tick
            if client_gone(request):
                timer.is_client_gone = True
                raise ClientGone()
            continue
        now = time.monotonic()
        for index, delta in batch:
            outputs[index].add(delta)
            timer.tokens(index, len(delta.token_ids), now)
    timer.finished(outputs)
    _raise_for(outputs)
    build = chat_completion if plan.api == "chat" else text_completion
    return web.json_response(build(plan, response_id, outputs),
                             headers={REQUEST_IDS_HEADER: ",".join(req_ids)})


def _with_event_id(frames: bytes, seq: int) -> bytes:
    """A delta's frames with `id: <seq>` on the last of them: Last-Event-ID then says that the
    whole delta arrived (GET /v1/requests/{id}/events resumes after it)."""
    head, data, last = frames.rpartition(b"data: ")
    return b"%sid: %d\n%s%s" % (head, seq, data, last)


async def _stream(request: web.Request, plan: Plan, response_id: str, watch: Watch, timer: _Timer,
                  req_ids: list[str]) -> web.StreamResponse:
    stream = EventStream(request)
    stream.response.headers[REQUEST_IDS_HEADER] = ",".join(req_ids)
    await stream.open()
    chunks = ChunkMaker(plan, response_id)
    is_single = len(plan.choices) == 1  # one request: its sequence numbers are the events' ids
    outputs = timer.outputs = [ChoiceOutput(choice.index) for choice in plan.choices]
    keepalive_s = request.app[SETTINGS].keepalive_s
    try:
        for index in range(len(plan.choices)):
            opening = chunks.opening(index)
            if opening is not None:
                await stream.send(opening)
        async for batch in watch.batches():
            if not batch:  # a quiet tick
                await stream.keep_alive(keepalive_s)
                continue
            now = time.monotonic()
            frames = []  # the batch's chunks, sent in one write
            for index, delta in batch:
                outputs[index].count(delta)
                timer.tokens(index, len(delta.token_ids), now)
                chunk = chunks.delta_frame(index, delta)
                if chunk is not None:
                    frames.append(_with_event_id(chunk, delta.seq) if is_single else chunk)
                if delta.is_final and delta.state in ("failed", "expired") and delta.error is not None:
                    error = UpstreamFailed(delta.error.get("message", "the request failed"),
                                           code=delta.error.get("code"))
                    frames.append(frame({"error": {"message": error.message, "type": error.error_type,
                                                   "param": None, "code": error.code}}))
            if frames:
                await stream.write(frames[0] if len(frames) == 1 else b"".join(frames))
        timer.finished(outputs)
        if plan.include_usage:
            await stream.send(chunks.usage(outputs))
        await stream.send("[DONE]")
    except ConnectionError:
        timer.is_client_gone = True  # the client left; following() cancels what has not ended
    finally:
        await stream.close()
    return stream.response
