"""POST /v1/embeddings: one queued request per input (embedded together by the replica's steps),
followed until every one has ended, answered with their vectors in input order."""

from __future__ import annotations

import time

from aiohttp import web

from gateway.api.embeddings.format import embedding_list
from gateway.api.embeddings.plan import EmbeddingPlan, plan_embeddings
from gateway.api.embeddings.schemas import EmbeddingRequest
from gateway.api.models.adapters import resolve_model
from gateway.core.appkeys import TASKS
from gateway.errors import BadRequest, UpstreamFailed
from gateway.serving.handlers import (
    ClientGone,
    admit,
    admit_tenant,
    client_gone,
    following,
    new_req_id,
    read_body,
    tenant_leases,
)
from gateway.serving.plan import ChoicePlan, Plan
from gateway.serving.store import STORE, RequestStore, Submission
from gateway.tenants.directory import Tenant
from gateway.tenants.limits import LIMITER
from gateway.tokens.tokenize_pool import TOKENIZE
from protocol.messages import RequestMessage
from protocol.result_record import ErrorCode, ResultRecord
from shared.pooling_params import POOLING_SAMPLING

API = "embedding"  # the record's `api`


def queued_plan(plan: EmbeddingPlan) -> Plan:
    """What admission and a tenant's charge read: one choice per input, no output tokens."""
    choices = [ChoicePlan(i, i, prompt, POOLING_SAMPLING) for i, prompt in enumerate(plan.prompts)]
    return Plan(API, plan.model, choices, [], [len(p) for p in plan.prompts])


def embedding_submissions(plan: EmbeddingPlan, req_ids: list[str], *, tenant: Tenant | None = None,
                          lease_until: float | None = None, **message_fields) -> list[Submission]:
    now = time.time()
    name = tenant.name if tenant is not None else None
    return [Submission(req_id, RequestMessage.make_embedding(req_id, plan.model.name, prompt, plan.pooling,
                                                             arrival_time=now, tenant=name, **message_fields),
                       API, lease_until=lease_until)
            for req_id, prompt in zip(req_ids, plan.prompts, strict=True)]


def vectors_of(records: list[ResultRecord | None]) -> list[str]:
    """Each request's vector (base64); the first that did not complete fails the call: the
    scheduler's refusal as a 400, anything else as a 502."""
    vectors = []
    for record in records:
        if record is None:
            raise UpstreamFailed("a request's record expired before it was read", code="request_failed")
        if record.state != "completed" or record.embedding is None:
            error = record.error or {}
            message = error.get("message") or f"the request ended {record.state}"
            if error.get("code") == ErrorCode.INVALID_REQUEST:
                raise BadRequest(message, code="invalid_request")
            raise UpstreamFailed(message, code=error.get("code") or "request_failed")
        vectors.append(record.embedding)
    return vectors


async def forget(store: RequestStore, req_ids: list[str]) -> None:
    """Delete the answered requests' records: a vector is kilobytes (16 KiB for 4,096 dimensions,
    as base64 22 KiB), nobody polls a /v1/embeddings call's ids, and a million calls a day would
    otherwise hold gigabytes for --result-ttl-s. (Single-key DELs: a cluster's slots differ.)"""
    pipe = store.client.pipeline(transaction=False)
    for req_id in req_ids:
        pipe.delete(store.keys.result(req_id))
    await pipe.execute()


async def create_embeddings(request: web.Request) -> web.Response:
    body, _ = await read_body(request, EmbeddingRequest)
    model, lora_name = await resolve_model(request, body.model)
    if lora_name is not None:
        raise BadRequest(f"{lora_name!r} is a LoRA adapter; adapters do not serve /v1/embeddings",
                         param="model")
    plan = await request.app[TOKENIZE].run(plan_embeddings, body, model)
    await admit(request, model.name, len(plan.prompts), runner="pooling")
    req_ids = [new_req_id() for _ in plan.prompts]
    tenant = await admit_tenant(request, queued_plan(plan), req_ids, output_tokens=0)
    lease_until = request.app[LIMITER].lease_for_queue(tenant) if tenant is not None else None
    store = request.app[STORE]
    async with tenant_leases(request, tenant, req_ids), following(request, model, req_ids) as watch:
        await store.submit(embedding_submissions(plan, req_ids, tenant=tenant, lease_until=lease_until))
        async for batch in watch.batches():
            if not batch and client_gone(request):  # a quiet tick: is anyone still waiting?
                raise ClientGone()
    vectors = vectors_of(await store.read_many(req_ids))
    request.app[TASKS].spawn(forget(store, req_ids), name="forget-embeddings")
    answer = embedding_list(model.name, vectors, plan.encoding_format, plan.num_prompt_tokens)
    return web.json_response(answer, headers={"tokenfleet-request-id": ",".join(req_ids)})
