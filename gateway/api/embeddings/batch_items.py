"""A Batch API `/v1/embeddings` line as the batch ingester queues it (one request per input,
as the route queues them) and as its output line answers (the route's body)."""

from __future__ import annotations

import time

from gateway.api.embeddings.format import embedding_list
from gateway.api.embeddings.plan import EmbeddingPlan
from protocol.messages import RequestMessage
from protocol.result_record import ResultRecord, queued_fields


def queue_args(plan: EmbeddingPlan, req_ids: list[str], result_keys: list[str], *, job_id: str,
               line_index: int, raw: str, custom_id: str, tenant: str | None) -> list[object]:
    """The batch feed script's ["R", record key, message, field count, fields...] per input."""
    now = time.time()
    args: list[object] = []
    for req_id, key, prompt in zip(req_ids, result_keys, plan.prompts, strict=True):
        message = RequestMessage.make_embedding(req_id, plan.model.name, prompt, plan.pooling, kind="batch",
                                                arrival_time=now, batch_job_id=job_id, custom_id=custom_id,
                                                tenant=tenant)
        record = queued_fields(model=plan.model.name, api="embedding", queued_at=now,
                               prompt_tokens=len(prompt),
                               batch=(job_id, line_index, len(plan.prompts), raw, custom_id))
        args += ["R", key, message.encode(), len(record)]
        for name, value in record.items():
            args += [name, value]
    return args


def output_body(plan: EmbeddingPlan, records: list[ResultRecord]) -> dict:
    vectors = [record.embedding or "" for record in records]
    return embedding_list(plan.model.name, vectors, plan.encoding_format,
                          sum(record.prompt_tokens for record in records))
