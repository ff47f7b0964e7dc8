"""What every generating route does: read the body, admit the request, queue it, follow it,
and write Server-Sent Events."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import TypeVar

from aiohttp import web
from pydantic import TypeAdapter

from gateway.core.appkeys import METRICS, REQUEST_ID, SETTINGS, TASKS
from gateway.errors import BadRequest, RateLimited
from gateway.fleet.queue_depth import QUEUE_DEPTHS
from gateway.fleet.tracker import FLEET
from gateway.serving.follow import Watch
from gateway.serving.plan import Plan
from gateway.serving.pubsub import ROUTER
from gateway.serving.sse import comment, frame
from gateway.serving.store import STORE, Submission
from gateway.tenants.access import TENANT
from gateway.tenants.directory import Tenant
from gateway.tenants.limits import LIMITER, OUTPUT_ESTIMATE_TOKENS
from gateway.tokens.models import ServedModel
from protocol.messages import RequestMessage

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection while we were waiting for its request."""


def new_req_id() -> str:
    return uuid.uuid4().hex  # server-made: safe inside Redis keys


async def read_body(request: web.Request, schema: type[T] | TypeAdapter) -> tuple[T, bytes]:
    """The validated body (strict JSON) and its bytes; 400 naming the field otherwise."""
    raw = await request.read()  # 413 past the app's client_max_size
    if not raw.strip():
        raise BadRequest("the body must be a JSON object", code="invalid_json")
    if isinstance(schema, TypeAdapter):
        return schema.validate_json(raw), raw
    return schema.model_validate_json(raw), raw


async def admit(request: web.Request, model: str, num_requests: int, *, runner: str = "generate") -> None:
    """503 when no scheduler serves the model, 400 when its schedulers run another runner than
    the route needs (generation on a `--runner pooling` model, or embeddings on a generating one),
    429 when its queue is full (against this process's estimate of the depth, read anew before a
    refusal: gateway/fleet/queue_depth.py)."""
    settings = request.app[SETTINGS]
    await request.app[FLEET].require(model)
    runners = request.app[FLEET].runners_of(model)
    if runners and runner not in runners:
        raise wrong_runner(model, runners.pop())
    if settings.max_queue > 0:
        depth = await request.app[QUEUE_DEPTHS].refusing_depth(model, num_requests, settings.max_queue)
        if depth is not None:
            raise RateLimited(
                f"the queue of model {model!r} is full ({depth} waiting, limit {settings.max_queue}); "
                "retry later", code="queue_full", headers={"Retry-After": str(settings.retry_after_s)})


def wrong_runner(model: str, runner: str) -> BadRequest:
    if runner == "pooling":
        return BadRequest(f"the model {model!r} runs with --runner pooling: it serves /v1/embeddings only, "
                          "not text generation", param="model", code="wrong_runner")
    return BadRequest(f"the model {model!r} runs with --runner {runner}: it does not serve /v1/embeddings "
                      "(its schedulers need --runner pooling)", param="model", code="wrong_runner")


def charged_output_tokens(plan: Plan, *, settles: bool) -> int:
    """The output tokens a call is charged when admitted (tokens_per_minute): its choices'
    max_tokens; for a call that gave none and settles on its actual use when it ends
    (TenantLimiter.settle), an estimate per choice (gateway/tenants/limits.py) instead of the rest of
    the context window, which alone may pass the tenant's limit."""
    if settles and not plan.max_tokens_given:
        return sum(min(choice.sampling.max_tokens, OUTPUT_ESTIMATE_TOKENS) for choice in plan.choices)
    return sum(choice.sampling.max_tokens for choice in plan.choices)


async def admit_tenant(request: web.Request, plan: Plan, req_ids: list[str],
                       output_tokens: int | None = None) -> Tenant | None:
    """The caller's tenant, once its limits allow these requests (429 naming the limit else),
    charged their prompts and `output_tokens` (charged_output_tokens; None: their max_tokens,
    for a caller that does not settle). Whoever admits must end the leases of requests it then
    fails to queue."""
    tenant = request.get(TENANT)
    if tenant is not None:
        if output_tokens is None:
            output_tokens = charged_output_tokens(plan, settles=False)
        num_tokens = sum(len(choice.prompt_ids) for choice in plan.choices) + output_tokens
        try:
            await request.app[LIMITER].admit(tenant, req_ids, num_tokens)
        except RateLimited as exc:
            request.app[METRICS].tenant_refusals.labels(tenant.name, exc.code).inc()
            raise
    return tenant


@contextlib.asynccontextmanager
async def tenant_leases(request: web.Request, tenant: Tenant | None,
                        req_ids: list[str]) -> AsyncIterator[None]:
    """The tenant's leases on these requests end when this call ends (done, failed, or its
    client gone): the requests are done or cancelled by then. (The scheduler's terminal write
    ends them too; whichever comes first.)"""
    try:
        yield
    finally:
        if tenant is not None:
            request.app[TASKS].spawn(request.app[LIMITER].release(tenant.name, req_ids), name="end-leases")


def submissions(plan: Plan, req_ids: list[str], deadline: float | None = None, *,
                tenant: Tenant | None = None, lease_until: float | None = None) -> list[Submission]:
    now = time.time()
    name = tenant.name if tenant is not None else None
    return [
        Submission(req_id, RequestMessage.make(req_id, plan.model.name, choice.prompt_ids, choice.sampling,
                                               priority=plan.priority, arrival_time=now, deadline=deadline,
                                               tenant=name, lora_name=plan.lora_name),
                   plan.api, plan.logprobs, tool_format=plan.tool_format,
                   parallel_tool_calls=plan.parallel_tool_calls, lease_until=lease_until,
                   prompt_top_logprobs=plan.prompt_logprobs,
                   echo=(plan.prompt_texts[choice.prompt_index], plan.is_prompt_only) if plan.echo else None)
        for req_id, choice in zip(req_ids, plan.choices, strict=True)
    ]


@contextlib.asynccontextmanager
async def following(request: web.Request, model: ServedModel, req_ids: list[str], *, after_seq: int = 0,
                    cancel_unfinished: bool = True) -> AsyncIterator[Watch]:
    """Subscribed to the requests' events while inside. Leaving early (the client left, an
    error) cancels the requests that have not ended, end to end, when cancel_unfinished."""
    app = request.app
    watch = Watch(app[STORE], app[ROUTER], req_ids, decode=model.decode, poll_s=app[SETTINGS].poll_s,
                  after_seq=after_seq)
    await watch.open()
    try:
        yield watch
    finally:
        watch.close()
        unfinished = watch.unfinished
        if cancel_unfinished and unfinished:
            app[TASKS].spawn(app[STORE].cancel(unfinished), name="cancel-abandoned")


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class EventStream:
    """A text/event-stream response. send() frames one event; write() sends frames built
    already (several at once: one write, one syscall)."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no", "X-Request-Id": request.get(REQUEST_ID, ""),
        })
        self._metrics = request.app[METRICS]
        self._is_open = False
        self._last_write = time.monotonic()

    async def open(self) -> None:
        await self.response.prepare(self.request)
        self._metrics.active_streams.inc()
        self._is_open = True
        self._last_write = time.monotonic()

    async def send(self, data: object, *, event_id: int | None = None, event: str | None = None) -> None:
        await self.write(frame(data, event_id=event_id, event=event))

    async def write(self, frames: bytes) -> None:
        await self.response.write(frames)
        self._last_write = time.monotonic()

    async def comment(self, text: str = "keep-alive") -> None:
        await self.write(comment(text))

    async def keep_alive(self, keepalive_s: float) -> None:
        """On a quiet spell: a comment once nothing was written for keepalive_s, so that
        proxies and clients keep an idle stream open."""
        if time.monotonic() - self._last_write >= keepalive_s:
            await self.comment()

    async def close(self) -> None:
        if self._is_open:
            self._is_open = False
            self._metrics.active_streams.dec()
            with contextlib.suppress(ConnectionError):
                await self.response.write_eof()
