"""A batch line as requests, and back: the base model and LoRA adapter a job's lines run on, a
line's plan, what queues its choices (their request messages and `tf:res` records, for the job's
feed step) or writes it off as an error line, and its output line once its choices' records
ended (the same response object the REST route answers). The ingester (ingester.py) feeds and
collects through it; it keeps no state between calls."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from gateway.api.batch.jobs import Job, item_req_id
from gateway.api.batch.lines import LineItem, error_line, output_line, parse_line, refusal_of, refused_line
from gateway.api.embeddings import batch_items as embedding_items
from gateway.api.embeddings.plan import EmbeddingPlan, plan_embeddings
from gateway.api.models.adapters import find_adapter
from gateway.api.openai.format import ChoiceOutput, chat_completion, text_completion
from gateway.api.openai.params import plan_chat, plan_completion
from gateway.core.settings import GatewaySettings
from gateway.errors import BadRequest, GatewayError, ModelNotFound
from gateway.serving.plan import Plan
from gateway.serving.records import ResultRecord
from gateway.tokens.models import ModelRegistry
from protocol.keys import Keys
from protocol.messages import RequestMessage
from protocol.result_record import queued_fields


class LineRequests:
    def __init__(self, client: aioredis.Redis, keys: Keys, models: ModelRegistry,
                 settings: GatewaySettings) -> None:
        self.client = client
        self.keys = keys
        self.models = models
        self.settings = settings

    async def target(self, job: Job) -> tuple[str | None, str | None]:
        """The base model a job's lines queue for, and the LoRA adapter they run with (None: the
        base). An adapter unloaded since the job started: its lines go to the only base model, whose
        schedulers refuse them (no such adapter) - or, with several, fail here."""
        if job.model is None or job.model in self.models.names:
            return job.model, None
        found = await find_adapter(self.client, self.keys, self.models, job.model,
                                   lambda record: record.owner in (None, job.tenant))
        if found is None:
            return (self.models.names[0] if len(self.models.names) == 1 else None), job.model
        return found[0].name, job.model

    def written_off(self, job: Job, item: LineItem) -> list[object]:
        code = f"batch_{job.ending}"
        message = "the job was cancelled before this line ran" if job.ending == "cancelled" else \
            "the job's completion window ended before this line ran"
        return ["E", item.index, item.custom_id or "",
                error_line(item.custom_id, item_req_id(job.id, item.index, 0), code, message)]

    def queued(self, job: Job, item: LineItem,
                    target: tuple[str | None, str | None] | None = None) -> list[object]:
        req0 = item_req_id(job.id, item.index, 0)
        if item.error is not None:
            return ["E", item.index, item.custom_id or "", refused_line(item.custom_id, req0, item.error)]
        try:
            line, plan = self.plan(job, item, target or (job.model, None))
        except GatewayError as exc:
            refused = refused_line(item.custom_id, req0, refusal_of(exc))
            return ["E", item.index, item.custom_id or "", refused]
        if isinstance(plan, EmbeddingPlan):
            ids = [item_req_id(job.id, item.index, i) for i in range(len(plan.prompts))]
            return embedding_items.queue_args(plan, ids, [self.keys.result(r) for r in ids], job_id=job.id,
                                              line_index=item.index, raw=item.raw,
                                              custom_id=line.custom_id, tenant=job.tenant)
        now = time.time()
        args: list[object] = []
        for c, choice in enumerate(plan.choices):
            req_id = item_req_id(job.id, item.index, c)
            message = RequestMessage.make(req_id, plan.model.name, choice.prompt_ids, choice.sampling,
                                          kind="batch", priority=plan.priority, arrival_time=now,
                                          batch_job_id=job.id, custom_id=line.custom_id, tenant=job.tenant,
                                          lora_name=plan.lora_name)
            record = queued_fields(model=plan.model.name, api=plan.api, queued_at=now,
                                   prompt_tokens=len(choice.prompt_ids), top_logprobs=plan.logprobs,
                                   batch=(job.id, item.index, len(plan.choices), item.raw, line.custom_id))
            args += ["R", self.keys.result(req_id), message.encode(), len(record)]
            for name, value in record.items():
                args += [name, value]
        return args

    def plan(self, job: Job, item: LineItem,
             target: tuple[str | None, str | None]) -> tuple[object, Plan | EmbeddingPlan]:
        """A line's plan, for `target` (target(): the base model, and the adapter or None)."""
        line, body = parse_line(item.raw)
        base, lora_name = target
        if lora_name is not None and base is None:
            raise ModelNotFound(f"the LoRA adapter {lora_name!r} is no longer loaded", param="model")
        model = self.models.get(base)
        if line.url == "/v1/embeddings":
            if lora_name is not None:
                raise BadRequest(f"{lora_name!r} is a LoRA adapter; adapters do not serve /v1/embeddings",
                                 param="body.model")
            return line, plan_embeddings(body, model)
        plan = plan_chat(body, model, self.settings) if line.url == "/v1/chat/completions" else \
            plan_completion(body, model, self.settings)
        plan.lora_name = lora_name
        return line, plan

    def output(self, job: Job, item: LineItem, records: list[ResultRecord],
                target: tuple[str | None, str | None]) -> tuple[bool, str]:
        req0 = records[0].req_id
        refused = next((r for r in records if r.is_refused), None)
        if refused is not None:  # the scheduler itself refused the input: what the REST route says
            refusal = {"status_code": 400, "code": "invalid_request", "param": None,
                       "message": refused.error["message"]}
            return False, refused_line(item.custom_id, req0, refusal)
        stopped = next((r for r in records if r.state in ("cancelled", "expired")), None)
        if stopped is not None:
            code = f"batch_{job.ending}" if job.ending else stopped.state
            message = f"the request was {stopped.state} before it ended"
            return False, error_line(item.custom_id, req0, code, message)
        failed = next((r for r in records if r.state == "failed"), None)
        if failed is not None:
            error = failed.error or {}
            return False, error_line(item.custom_id, req0, error.get("code", "request_failed"),
                                     error.get("message", "the request failed"))
        try:
            _, plan = self.plan(job, item, target)
        except GatewayError as exc:  # cannot happen for a line that was queued, but never lose it
            return False, error_line(item.custom_id, req0, exc.code or "invalid_value", exc.message)
        if isinstance(plan, EmbeddingPlan):
            return True, output_line(item.custom_id, req0, embedding_items.output_body(plan, records))
        outputs = [ChoiceOutput(c) for c in range(len(records))]
        for out, record in zip(outputs, records, strict=True):
            out.add(record.delta_after(0, plan.model.decode))
        if plan.api == "chat":
            body = chat_completion(plan, "chatcmpl-" + req0, outputs)
        else:
            body = text_completion(plan, "cmpl-" + req0, outputs)
        return True, output_line(item.custom_id, req0, body)
