"""What one engine step writes: each moved request's tf:res fields and appends, and its event.

Runs in the result publisher's process (service/publisher_process.py), which alone changes a
delivery's state: seq, tokens, text, offsets, logprobs.
"""

from __future__ import annotations

from protocol.messages import ErrorEvent, TokenEvent, pack_list_chunk
from protocol.result_record import (
    embedding_fields,
    progress_fields,
    prompt_logprobs_fields,
    step_appends,
    step_fields,
    terminal_fields,
)
from protocol.usage import Usage
from scheduler.detokenizer import IncrementalDetokenizer
from scheduler.request import FinishReason
from service.delivery import Delivery, StepOutput
from service.result_store import ResultUpdate


def step_update(delivery: Delivery, out: StepOutput, now: float) -> ResultUpdate | None:
    """The record change and event of one step's output for one request (None: nothing to say)."""
    text_delta = out.text_delta
    if delivery.detokenizer is not None:
        text_delta = _text_of(delivery.detokenizer, out)
    if not (out.new_token_ids or text_delta or out.finished):
        return None
    delivery.seq += 1
    delivery.token_ids += out.new_token_ids
    delivery.text += text_delta
    delivery.offsets.append([len(delivery.token_ids), len(delivery.text)])
    is_first_token = bool(out.new_token_ids) and delivery.first_token_at is None
    if is_first_token:
        delivery.first_token_at = now
    logprobs = out.logprobs if delivery.wants_logprobs and out.logprobs else None
    if logprobs:
        delivery.logprobs += logprobs
    if out.prompt_logprobs is not None:
        delivery.prompt_logprobs = out.prompt_logprobs
    if delivery.is_batch and not out.finished:
        return None  # nobody streams a batch item: its record is written once, at the end
    if delivery.is_batch:
        fields, appends, event = _progress_fields(delivery), {}, None
    else:
        fields, appends = _step_fields(delivery, out.new_token_ids, text_delta, logprobs, is_first_token)
        event = TokenEvent(out.req_id, delivery.seq, out.new_token_ids, text_delta, logprobs)
        if out.prompt_logprobs is not None:
            event.prompt_logprobs = out.prompt_logprobs
            fields.update(prompt_logprobs_fields(out.prompt_logprobs))
    ack = None
    if out.finished:
        usage = Usage(delivery.num_prompt_tokens, len(delivery.token_ids), out.num_cached_tokens).to_dict()
        if event is not None:
            event.finish_reason = out.finish_reason
            event.usage = usage
        state = "cancelled" if out.finish_reason == FinishReason.ABORT.value else "completed"
        fields.update(terminal_fields(state, finish_reason=out.finish_reason, usage=usage,
                                      stop_reason=out.stop_reason))
        if out.embedding is not None:
            fields.update(embedding_fields(out.embedding))
        ack = delivery.entry_id
    return ResultUpdate(out.req_id, delivery.stream, fields, None if event is None else event.encode(), ack,
                        batch_job_id=delivery.batch_job_id, appends=appends)


def unrun_update(delivery: Delivery, state: str, code: str, message: str) -> ResultUpdate:
    """The end of a request that made no token here (cancelled or expired before it ran, or
    refused): an ErrorEvent, the record terminal, the entry acknowledged."""
    delivery.seq += 1
    delivery.offsets.append([len(delivery.token_ids), len(delivery.text)])
    event = ErrorEvent(delivery.req_id, delivery.seq, code, message).encode()
    fields = terminal_fields(state, error_code=code, error_message=message, seq=delivery.seq)
    appends = step_appends(pack_list_chunk([delivery.offsets[-1]]))
    return ResultUpdate(delivery.req_id, delivery.stream, fields, event=event, ack_entry_id=delivery.entry_id,
                        batch_job_id=delivery.batch_job_id, appends=appends)


def whole_record_updates(delivery: Delivery, gapped: list[ResultUpdate]) -> list[ResultUpdate]:
    """In place of a request's updates whose chunks found its record missing earlier ones (Redis
    lost its last writes): everything delivered so far set at once, with what those updates set
    and acknowledged, then their events, in order."""
    fields: dict[str, object] = {}
    for update in gapped:
        fields.update(update.fields)
    fields.update(_progress_fields(delivery))
    ack = next((u.ack_entry_id for u in reversed(gapped) if u.ack_entry_id is not None), None)
    whole = ResultUpdate(delivery.req_id, delivery.stream, fields, None, ack,
                         batch_job_id=delivery.batch_job_id)
    return [whole, *(ResultUpdate(delivery.req_id, delivery.stream, {}, u.event) for u in gapped if u.event)]


def _text_of(detokenizer: IncrementalDetokenizer, out: StepOutput) -> str:
    """The text a step's tokens add, as the engine would have made it: the EOS or stop token
    that ended a request adds none, and an aborted request's held-back text stays held."""
    token_ids = out.new_token_ids
    if out.finish_reason == FinishReason.STOP.value:  # (stop strings never come here)
        token_ids = token_ids[:-1]
    text = "".join(detokenizer.add_token(token_id) for token_id in token_ids)
    if out.finished and out.finish_reason != FinishReason.ABORT.value:
        text += detokenizer.finish()
    return text


def _step_fields(delivery: Delivery, new_token_ids: list[int], text_delta: str, logprobs: list | None,
                 is_first_token: bool) -> tuple[dict[str, object], dict[str, str | bytes]]:
    """What one step adds to tf:res: the new tokens, text and offsets appended (only they are
    packed and sent, not everything so far), the seq set."""
    fields = step_fields(delivery.seq, first_token_at=delivery.first_token_at if is_first_token else None)
    appends = step_appends(pack_list_chunk([delivery.offsets[-1]]),
                           token_ids_chunk=pack_list_chunk(new_token_ids) if new_token_ids else None,
                           text=text_delta,
                           logprobs_chunk=pack_list_chunk(logprobs) if logprobs else None)
    return fields, appends


def _progress_fields(delivery: Delivery) -> dict[str, object]:
    """Everything delivered so far, as tf:res fields (a successor resumes from them)."""
    fields = progress_fields(delivery.seq, delivery.text, pack_list_chunk(delivery.token_ids),
                             pack_list_chunk(delivery.offsets), first_token_at=delivery.first_token_at,
                             logprobs_chunk=pack_list_chunk(delivery.logprobs) if delivery.logprobs else None)
    if delivery.prompt_logprobs is not None:
        fields.update(prompt_logprobs_fields(delivery.prompt_logprobs))
    return fields
