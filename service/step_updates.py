"""What one engine step writes: each moved request's tf:res fields and appends, and its event.

Runs on the result writer's thread (service/result_writer.py), which alone changes a flight's
delivery state: seq, tokens, text, offsets, logprobs.
"""

from __future__ import annotations

from protocol.messages import TokenEvent, pack_list_chunk
from protocol.result_record import progress_fields, step_appends, step_fields, terminal_fields
from scheduler.detokenizer import IncrementalDetokenizer
from scheduler.engine import Usage
from scheduler.request import FinishReason
from scheduler.scheduler import RequestOutput
from service.inflight import InFlight
from service.result_store import ResultUpdate


def updates_for(step: list[tuple[InFlight, RequestOutput]], now: float) -> list[ResultUpdate]:
    """The records and events of one step (runs on the writer thread, which alone changes a
    flight's delivery state: seq, tokens, text, offsets, logprobs)."""
    updates = []
    for flight, out in step:
        if flight.detokenizer is not None:
            out.text_delta = _text_of(flight.detokenizer, out)
        if not (out.new_token_ids or out.text_delta or out.finished):
            continue
        flight.seq += 1
        flight.token_ids += out.new_token_ids
        flight.text += out.text_delta
        flight.offsets.append([len(flight.token_ids), len(flight.text)])
        is_first_token = bool(out.new_token_ids) and flight.first_token_at is None
        if is_first_token:
            flight.first_token_at = now
        logprobs = None
        if flight.wants_logprobs and out.logprobs:
            logprobs = [[lp.token_id, lp.logprob, lp.top_logprobs] for lp in out.logprobs]
            flight.logprobs += logprobs
        if flight.is_batch and not out.finished:
            continue  # nobody streams a batch item: its record is written once, at the end
        if flight.is_batch:
            fields, appends, event = _progress_fields(flight), {}, None
        else:
            fields, appends = _step_fields(flight, out.new_token_ids, out.text_delta, logprobs,
                                                is_first_token)
            event = TokenEvent(out.req_id, flight.seq, out.new_token_ids, out.text_delta, logprobs)
        ack = None
        if out.finished:
            usage = Usage(flight.num_prompt_tokens, len(flight.token_ids),
                          out.num_cached_tokens).to_dict()
            if event is not None:
                event.finish_reason = out.finish_reason.value
                event.usage = usage
            state = "cancelled" if out.finish_reason is FinishReason.ABORT else "completed"
            fields.update(terminal_fields(state, finish_reason=out.finish_reason.value, usage=usage,
                                          stop_reason=out.stop_reason))
            ack = flight.entry_id
        updates.append(ResultUpdate(out.req_id, flight.stream, fields,
                                    None if event is None else event.encode(), ack,
                                    batch_job_id=flight.batch_job_id, appends=appends))
    return updates

def _text_of(detokenizer: IncrementalDetokenizer, out: RequestOutput) -> str:
    """The text a step's tokens add, as the engine would have made it: the EOS or stop token
    that ended a request adds none, and an aborted request's held-back text stays held."""
    token_ids = out.new_token_ids
    if out.finish_reason is FinishReason.STOP:  # (stop strings never come here)
        token_ids = token_ids[:-1]
    text = "".join(detokenizer.add_token(token_id) for token_id in token_ids)
    if out.finished and out.finish_reason is not FinishReason.ABORT:
        text += detokenizer.finish()
    return text

def _step_fields(flight: InFlight, new_token_ids: list[int], text_delta: str, logprobs: list | None,
                 is_first_token: bool) -> tuple[dict[str, object], dict[str, str | bytes]]:
    """What one step adds to tf:res: the new tokens, text and offsets appended (only they are
    packed and sent, not everything so far), the seq set."""
    fields = step_fields(flight.seq, first_token_at=flight.first_token_at if is_first_token else None)
    appends = step_appends(pack_list_chunk([flight.offsets[-1]]),
                           token_ids_chunk=pack_list_chunk(new_token_ids) if new_token_ids else None,
                           text=text_delta,
                           logprobs_chunk=pack_list_chunk(logprobs) if logprobs else None)
    return fields, appends

def _progress_fields(flight: InFlight) -> dict[str, object]:
    """Everything delivered so far, as tf:res fields (a successor resumes from them)."""
    return progress_fields(flight.seq, flight.text, pack_list_chunk(flight.token_ids),
                           pack_list_chunk(flight.offsets), first_token_at=flight.first_token_at,
                           logprobs_chunk=pack_list_chunk(flight.logprobs) if flight.logprobs else None)
