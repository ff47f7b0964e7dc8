"""Finishing a step: `update_from_output()` records what it computed and sampled.

Stop checks, aborts and preemption act when a step is taken back, so under async scheduling
they may be one step late: what the step ahead computed for a request that has finished, been
aborted or been preempted meanwhile is dropped, never returned nor counted (its blocks are freed
with the request's; the device runs the steps in order, so nothing handed out again is written
by the late step after its new owner).

Under async scheduling a step ahead whose constrained rows' inputs are this step's tokens
samples late (scheduler/grammar.py): its mask needs those tokens accepted by the matchers. So
`update_from_output` can take the constrained rows first and call `on_grammars_accepted` (the
engine samples the step ahead there) before the other rows' tokens, stop checks and outputs:
the step ahead's sampling, which the device waits for, waits for the constrained rows only,
not for the whole batch's host work. The outputs come back in batch order either way.

Speculative decoding: the step returns how many drafts the workers accepted (`_take_verified`):
those and the target's next token are appended (cut at a stop or max_tokens), the computed length
moves past the accepted ones only, and blocks holding only rejected drafts go back.

A part of `Scheduler` (scheduler.py), whose state it reads and changes.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

from scheduler.prompt_logprobs import prompt_logprobs_to_send, take_prompt_logprobs
from scheduler.request import FinishReason, Request, RequestStatus, TokenLogprobs
from scheduler.step_plan import RequestOutput, SchedulerOutput
from shared.errors import WorkerError
from shared.step import SampledToken, SequenceWork, StepResult


class Finishing:
    def update_from_output(
        self, scheduler_output: SchedulerOutput, step_result: StepResult,
        on_grammars_accepted: Callable[[], None] | None = None,
    ) -> list[RequestOutput]:
        """Record what the step computed and sampled; return one output per changed request.
        `on_grammars_accepted`: called once the constrained rows' tokens are accepted, before the
        other rows are taken (every row is taken in batch order without it).

        Raises WorkerError when the result does not match the batch (wrong step, missing
        or extra sampled tokens).
        """
        batch = scheduler_output.batch
        if step_result.step_id != batch.step_id:
            raise WorkerError(f"result of step {step_result.step_id} for batch {batch.step_id}")
        self._computing_in_flight.subtract(scheduler_output.computing_block_hashes)
        self._computing_in_flight += Counter()  # drops the hashes no step computes any more
        self._copies_done(batch.step_id, step_result)
        outputs = [self._report_abort(request) for request in self._aborted]
        self._aborted = []
        sampled_tokens = iter(step_result.sampled)
        scheduled = scheduler_output.scheduled_requests or [
            (self._requests.get(w.req_id), None) for w in batch.works]  # an output built by hand (tests)
        rows = []
        for work, (request, num_preemptions) in zip(batch.works, scheduled, strict=True):
            sampled = next(sampled_tokens, None) if work.is_sampled else None
            if work.is_sampled and (sampled is None or sampled.req_id != work.req_id):
                raise WorkerError(f"step {batch.step_id}: no sampled token for {work.req_id!r}")
            rows.append((work, request, num_preemptions, sampled))
        if next(sampled_tokens, None) is not None:
            raise WorkerError(f"step {batch.step_id}: more sampled tokens than sampled works")
        if on_grammars_accepted is None or self.grammars is None:
            outputs += [out for row in rows if (out := self._take_row(step_result, *row)) is not None]
            if on_grammars_accepted is not None:
                on_grammars_accepted()
            return outputs
        by_row: dict[int, RequestOutput | None] = {}
        for first in (True, False):
            for index, row in enumerate(rows):
                if (row[0].req_id in self.grammars) is first and index not in by_row:
                    by_row[index] = self._take_row(step_result, *row)
            if first:
                on_grammars_accepted()
        return outputs + [by_row[index] for index in range(len(rows)) if by_row[index] is not None]

    def _take_row(self, step_result: StepResult, work: SequenceWork, request: Request | None,
                  num_preemptions: int | None, sampled: SampledToken | None) -> RequestOutput | None:
        """What one row of the step did for its request; its output, if it has one."""
        if work.num_draft_tokens:
            self._drafting.discard(work.req_id)
        if request is None or request.status is not RequestStatus.RUNNING or (
                num_preemptions is not None and request.num_preemptions != num_preemptions):
            # Aborted, finished or preempted after schedule(): what the step did for it is moot
            # (a token past a stop, an abort or max_tokens is dropped here, never counted).
            return None
        if work.num_draft_tokens:
            return self._take_verified(request, work, sampled)
        if work.prompt_logprob_ids:
            take_prompt_logprobs(request, work, step_result)
        request.num_computed_tokens += len(work.token_ids)
        request.num_in_flight_tokens -= len(work.token_ids)
        self.block_manager.register_full_blocks(request)
        if sampled is None:
            return None
        request.num_pending_tokens -= 1
        return self._append_token(request, sampled)

    def _copies_done(self, step_id: int, step_result: StepResult) -> None:
        """The host tier's copies of the step are complete: the requests whose prefix it loaded
        run from the next step on, their loaded blocks findable in the GPU cache."""
        if self.host_tier is None:
            return
        self.host_tier.step_done(step_id, self.block_manager, step_result.kv_load_seconds)
        for request in self._loading.pop(step_id, []):
            if request.loading_step_id != step_id or request.status is not RequestStatus.RUNNING:
                continue  # aborted meanwhile: its blocks went back with the copies' holds
            request.loading_step_id = None
            self.block_manager.register_full_blocks(request)

    def _report_abort(self, request: Request) -> RequestOutput:
        self._forget(request.req_id)
        return RequestOutput(
            request.req_id, [], "", finished=True, finish_reason=FinishReason.ABORT,
            num_cached_tokens=request.num_cached_tokens or 0,
        )

    def _take_verified(self, request: Request, work: SequenceWork, sampled: SampledToken) -> RequestOutput:
        """A decode with drafts: its known token and the accepted drafts are computed; those
        drafts, then the target's own next token, are its output (cut at a stop or max_tokens)."""
        num_drafts, num_accepted = work.num_draft_tokens, sampled.num_accepted_drafts
        if not 0 <= num_accepted <= num_drafts:
            raise WorkerError(f"{work.req_id!r}: {num_accepted} of {num_drafts} drafts accepted")
        request.num_in_flight_tokens -= len(work.token_ids)
        request.num_pending_tokens -= 1
        request.num_computed_tokens += len(work.token_ids) - num_drafts + num_accepted
        accepted = work.token_ids[len(work.token_ids) - num_drafts:][:num_accepted]
        self.speculator.record(request, num_drafts, num_accepted)
        num_before = request.num_output_tokens
        output = self._append_token(request, sampled, accepted)
        self.speculator.num_emitted_tokens += request.num_output_tokens - num_before
        if not request.is_finished:
            # The rejected drafts' slots: blocks past the next input's are given back. The blocks
            # registered for the prefix cache are those of computed (accepted) tokens only.
            self.block_manager.free_tail(request, request.num_tokens)
            self.block_manager.register_full_blocks(request)
        return output

    def _forget(self, req_id: str) -> None:
        del self._requests[req_id]
        self._detokenizers.pop(req_id, None)
        if self.speculator is not None:
            self.speculator.forget(req_id)
        if self.grammars is not None:
            self.grammars.discard(req_id)

    def _append_token(self, request: Request, sampled: SampledToken,
                      accepted: list[int] | tuple = ()) -> RequestOutput:
        """`accepted`: speculative decoding's accepted drafts, which come before the sampled
        token; a stop among them ends the output there (nothing past it is returned)."""
        new_token_ids: list[int] = []
        text_delta = ""
        for token_id in accepted:
            request.output_token_ids.append(token_id)
            new_token_ids.append(token_id)
            text_delta += self._detokenize_and_check_stop(request, token_id)
            if request.is_finished:
                break
        logprobs = None
        wants_logprobs = request.sampling.logprobs is not None
        if not request.is_finished:
            request.output_token_ids.append(sampled.token_id)
            text_delta += self._detokenize_and_check_stop(request, sampled.token_id)
            new_token_ids.append(sampled.token_id)
            # As OpenAI: the token that ended the request by being a stop token (EOS, a stop
            # token id) adds no text, so it gets no logprobs entry either; the entries' bytes
            # then rebuild the content.
            if wants_logprobs and not request.ended_on_stop_token:
                logprobs = [TokenLogprobs(sampled.token_id, sampled.logprob, sampled.top_logprobs)]
                request.output_logprobs.extend(logprobs)
        # Jump-forward (scheduler/grammar.py): text the grammar forces now, appended unsampled.
        forced = self.grammars.forced_tokens(request.req_id) if self.grammars and not wants_logprobs else []
        for token_id in itertools.takewhile(lambda _: not request.is_finished, forced):
            request.output_token_ids.append(token_id)
            new_token_ids.append(token_id)
            text_delta += self._detokenize_and_check_stop(request, token_id)
        request.output_text += text_delta
        if request.is_finished:
            self._running.remove(request)
            self._free_blocks(request)
            self._forget(request.req_id)
        return RequestOutput(
            request.req_id, new_token_ids, text_delta, finished=request.is_finished,
            finish_reason=request.finish_reason, stop_reason=request.stop_reason, logprobs=logprobs,
            num_cached_tokens=request.num_cached_tokens or 0,
            prompt_logprobs=prompt_logprobs_to_send(request))

    def _detokenize_and_check_stop(self, request: Request, token_id: int) -> str:
        """Text the token adds; finishes the request when it meets a stop condition."""
        detokenizer = self._detokenizers.get(request.req_id)
        sampling = request.sampling
        text_delta = ""
        grammar_ended = self.grammars is not None and self.grammars.accept(request.req_id, token_id)
        if grammar_ended or (token_id in request.eos_token_ids and not sampling.ignore_eos):
            # As in vLLM: EOS and stop tokens stay in the token ids but add no text. A grammar
            # ends only on one of its stop tokens (the EOS ids), with or without ignore_eos.
            request.finish(RequestStatus.FINISHED_STOPPED)
        elif token_id in request.stop_token_set:
            request.finish(RequestStatus.FINISHED_STOPPED, stop_reason=token_id)
        elif detokenizer is not None:
            text_delta = detokenizer.add_token(token_id)
            if detokenizer.matched_stop is not None:
                request.finish(RequestStatus.FINISHED_STOPPED, stop_reason=detokenizer.matched_stop)
        if not request.is_finished and (
            request.num_output_tokens >= sampling.max_tokens
            or request.num_tokens >= self._max_num_tokens
        ):
            request.finish(RequestStatus.FINISHED_LENGTH)
        if request.is_finished and detokenizer is not None:
            text_delta += detokenizer.finish()
        return text_delta
