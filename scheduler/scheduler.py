"""Iteration-level scheduler: which requests compute how many tokens in each step.

Every step, running requests go first (decodes, then the next chunk of those still
prefilling), then waiting requests in order of importance, as long as the token budget,
the sequence cap and the KV cache allow. When the cache runs out, the least important
running request is preempted: its blocks are freed and it later recomputes its prompt
and output from scratch (num_computed_tokens back to 0).

With prefix caching, a request admitted from the waiting queue starts after the longest
prefix of its tokens whose full blocks are in the cache (block_manager.py); blocks are made
findable once the step that computed them is over, and a preempted request's blocks stay
cached, so it usually resumes from them.

Under pipeline parallelism several steps are in flight at once (the engine submits the next
before the last one's tokens are back). A request in a step still in flight is left out of
the next ones, and never preempted, until that step's output has been taken back: its next
token, and the blocks the step writes, are not known before.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from scheduler.block_manager import BlockManager, cdiv, update_block_hashes
from scheduler.detokenizer import IncrementalDetokenizer, Tokenizer
from scheduler.fair_share import FairShare
from scheduler.grammar import Grammars
from scheduler.request import BATCH_PRIORITY, FinishReason, Request, RequestStatus, TokenLogprobs
from shared.errors import InvalidRequestError, WorkerError
from shared.logging import get_logger
from shared.step import SampledToken, SequenceWork, StepBatch, StepResult

logger = get_logger(__name__)


@dataclass
class SchedulerConfig:
    max_model_len: int  # prompt + output tokens of one sequence
    num_kv_blocks: int
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 256  # cap on the sequences of one step (and on running ones, per step in flight)
    max_num_batched_tokens: int = 2048  # per-step token budget
    # Cap on one request's prefill chunk per step, so several prompts can progress at once;
    # None: a prefill takes whatever budget the decodes leave.
    long_prefill_chunk: int | None = None
    enable_prefix_caching: bool = True
    # Steps in flight at once (a pipeline's stages): each step takes about 1/depth of the
    # requests, so that every in-flight step has some.
    pipeline_depth: int = 1

    def __post_init__(self) -> None:
        for name in ("max_model_len", "num_kv_blocks", "block_size", "max_num_seqs",
                     "max_num_batched_tokens", "pipeline_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_chunk is not None and self.long_prefill_chunk < 1:
            raise ValueError(f"long_prefill_chunk must be >= 1, got {self.long_prefill_chunk}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Otherwise some running sequences could not decode in a step and would starve.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )


@dataclass
class SchedulerOutput:
    batch: StepBatch
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens computed this step, batch order
    preempted_req_ids: list[str]  # preempted during this schedule() call

    @property
    def scheduled_req_ids(self) -> list[str]:
        return list(self.num_scheduled_tokens)


@dataclass
class RequestOutput:
    """What one step added to one request, for streaming back to its client."""

    req_id: str
    new_token_ids: list[int]
    text_delta: str  # new text since the previous output (empty while held back)
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprobs] | None = None  # of new_token_ids; None if not asked for
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache


@dataclass
class _StepPlan:
    """What schedule() has decided so far; preemption can take a decision back."""

    token_budget: int
    max_num_seqs: int  # sequences this step may take
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # req_id -> tokens
    preempted_req_ids: list[str] = field(default_factory=list)
    # Hashes of the full blocks this step's prefills compute: cached from the next step on.
    computing_block_hashes: set[bytes] = field(default_factory=set)

    def add(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled_tokens[request.req_id] = num_tokens
        self.token_budget -= num_tokens

    @property
    def has_seq_room(self) -> bool:
        return len(self.num_scheduled_tokens) < self.max_num_seqs

    def remove(self, request: Request) -> None:
        self.token_budget += self.num_scheduled_tokens.pop(request.req_id, 0)


def _importance(request: Request) -> tuple[int, float]:
    """Sort key: most important first (lower priority number, then earlier arrival)."""
    return (request.priority, request.arrival_time)


class Scheduler:
    def __init__(self, config: SchedulerConfig, tokenizer: Tokenizer | None = None,
                 grammars: Grammars | None = None) -> None:
        """Without a tokenizer, outputs carry token ids only (no text, no stop strings); without
        `grammars`, requests with a grammar are refused."""
        self.config = config
        self.grammars = grammars
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self._tokenizer = tokenizer
        # A sequence may not outgrow the model's window, nor the whole cache: a request
        # alone must always fit, or preempting it and resuming it would loop forever.
        self._max_num_tokens = min(config.max_model_len, config.num_kv_blocks * config.block_size)
        self._requests: dict[str, Request] = {}  # req_id -> request not yet reported finished
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}  # req_id -> its detokenizer
        # Kept sorted by _importance. A preempted request keeps its arrival time, so it goes
        # back ahead of every later arrival of its priority.
        self._waiting: list[Request] = []
        self._fair_share = FairShare()  # which tenant's waiting request starts next, per priority
        self._running: list[Request] = []  # in admission order
        self._in_flight: set[str] = set()  # req_ids in steps scheduled and not yet taken back
        self._aborted: list[Request] = []  # aborted since the last update_from_output
        self._next_step_id = 0
        # When set, only requests with stop strings are detokenized here (their text decides when
        # they stop); the caller turns the others' tokens into text off the step's critical path.
        self.text_for_stop_strings_only = False

    # -- requests in and out ---------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request; raise InvalidRequestError if it can never run."""
        self._validate(request)
        if request.sampling.grammar is not None:
            if self.grammars is None:
                raise InvalidRequestError("this scheduler runs no grammars", param="response_format")
            # Replays the output a resumed request already has: the grammar continues after it.
            self.grammars.add(request.req_id, request.sampling.grammar, request.output_token_ids)
        self._requests[request.req_id] = request
        if self._tokenizer is not None and (request.sampling.stop or not self.text_for_stop_strings_only):
            self._detokenizers[request.req_id] = IncrementalDetokenizer(
                # A request resumed from stored tokens continues after them: they are context.
                self._tokenizer, request.all_token_ids, stop=request.sampling.stop
            )
        request.status = RequestStatus.WAITING
        bisect.insort(self._waiting, request, key=_importance)

    def abort_request(self, req_id: str) -> None:
        """Stop a request now; its abort output comes with the next update_from_output.

        Unknown or already finished requests are ignored: the client may abort a request
        that finished on its own a moment before.
        """
        request = self._requests.get(req_id)
        if request is None or request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self.block_manager.free(request)
        request.finish(RequestStatus.FINISHED_ABORTED)
        self._aborted.append(request)

    def get_request(self, req_id: str) -> Request | None:
        """The request, until its finished output has been returned."""
        return self._requests.get(req_id)

    def has_unfinished_requests(self) -> bool:
        """True while requests wait or run, or an abort is still to be reported."""
        return bool(self._waiting or self._running or self._aborted)

    @property
    def num_running_requests(self) -> int:
        return len(self._running)

    @property
    def num_waiting_requests(self) -> int:
        return len(self._waiting)

    def _validate(self, request: Request) -> None:
        if request.req_id in self._requests:
            raise InvalidRequestError(f"request id {request.req_id!r} is already in use")
        request.sampling.validate()
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if num_prompt >= self.config.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens, which leaves no room to generate "
                f"within max_model_len={self.config.max_model_len}",
                param="prompt",
            )
        num_blocks = cdiv(num_prompt, self.config.block_size)
        if num_blocks > self.config.num_kv_blocks:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens and needs {num_blocks} KV cache blocks, "
                f"but the cache has only {self.config.num_kv_blocks}",
                param="prompt",
            )
        if request.sampling.stop and self._tokenizer is None:
            raise InvalidRequestError(
                "stop strings need a scheduler with a tokenizer", param="stop"
            )

    # -- one step: schedule ----------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(token_budget=self.config.max_num_batched_tokens,
                         max_num_seqs=self._step_seq_budget())
        self._schedule_running(plan)
        # Blocks just freed by preemption are for the running requests that needed them;
        # admitting new ones now would only preempt again.
        if not plan.preempted_req_ids:
            self._schedule_waiting(plan)
        works = [
            self._make_work(self._requests[req_id], num_tokens)
            for req_id, num_tokens in plan.num_scheduled_tokens.items()
        ]
        batch = StepBatch(step_id=self._next_step_id, works=works)
        if self.grammars is not None:  # the runner fills it once the forward runs (shared/step.py)
            batch.mask_filler = self.grammars.mask_filler(works)
        self._next_step_id += 1
        self._in_flight.update(plan.num_scheduled_tokens)
        return SchedulerOutput(batch, plan.num_scheduled_tokens, plan.preempted_req_ids)

    def _step_seq_budget(self) -> int:
        """Sequences this step may take: all of max_num_seqs, but for a pipeline a 1/depth share
        of the requests there are (rounded up), so that the steps in flight split them evenly."""
        depth = self.config.pipeline_depth
        if depth == 1:
            return self.config.max_num_seqs
        num_requests = len(self._running) + len(self._waiting)
        return max(1, min(self.config.max_num_seqs, -(-num_requests // depth)))

    def _schedule_running(self, plan: _StepPlan) -> None:
        # Decodes first: a request still prefilling gets what they leave, so a long prompt
        # never holds back the decodes of others for more than its current chunk.
        by_decodes_first = sorted(
            self._running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1
        )
        for request in by_decodes_first:
            if not plan.has_seq_room:
                break  # the rest go with the next step (a pipeline's share)
            if request.status is not RequestStatus.RUNNING or request.req_id in self._in_flight:
                continue  # preempted for another request earlier in this loop, or in flight
            num_new_tokens = self._num_new_tokens(request, plan.token_budget)
            if num_new_tokens == 0:
                continue
            while not self.block_manager.allocate_slots(request, num_new_tokens):
                victim = max((r for r in self._running if r.req_id not in self._in_flight),
                             key=_importance)  # `request` itself at worst
                self._preempt(victim, plan)
                if victim is request:
                    break
            else:
                plan.add(request, num_new_tokens)
                self._note_computing(request, num_new_tokens, plan)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        admits_interactive = False
        # Strict priorities; tenants take turns inside one (scheduler/fair_share.py).
        for request in self._fair_share.order(self._waiting):
            if plan.token_budget <= 0:
                break
            if self.config.pipeline_depth > 1 and not plan.has_seq_room:
                break  # this step's share is taken; the next step in flight takes the next ones
            if request.req_id in plan.preempted_req_ids:
                break  # just made room for a more important one; not back in this step
            if admits_interactive and request.priority >= BATCH_PRIORITY:
                # Batch prompts do not share a step with an interactive prompt: the step that
                # gives an interactive request its first token stays as short as its own prefill.
                break
            cached_block_ids = self.block_manager.find_cached_prefix(request)
            if self._prefix_is_being_computed(request, len(cached_block_ids), plan):
                # Wait one step and take those blocks from the cache, rather than compute them
                # twice (a burst of chats with one system prompt computes it once).
                break
            num_new_tokens = self._num_new_tokens(
                request, plan.token_budget, len(cached_block_ids) * self.config.block_size)
            if not self._make_room(request, num_new_tokens, plan, cached_block_ids):
                break  # strict order: later requests do not jump ahead of a stuck one
            self.block_manager.record_first_admission(request)
            self._waiting.remove(request)
            self._fair_share.started(request)
            admits_interactive = admits_interactive or request.priority < BATCH_PRIORITY
            request.status = RequestStatus.RUNNING
            self._running.append(request)
            plan.add(request, num_new_tokens)
            self._note_computing(request, num_new_tokens, plan)

    def _note_computing(self, request: Request, num_new_tokens: int, plan: _StepPlan) -> None:
        if num_new_tokens <= 1 or not self.config.enable_prefix_caching:
            return  # a decode's block is its own output: not worth waiting for
        hashes = update_block_hashes(request, self.config.block_size)
        first = request.num_computed_tokens // self.config.block_size
        end = (request.num_computed_tokens + num_new_tokens) // self.config.block_size
        plan.computing_block_hashes.update(hashes[first:end])

    def _prefix_is_being_computed(self, request: Request, num_cached_blocks: int, plan: _StepPlan) -> bool:
        """Whether the request's first block not in the cache is computed in this step by another."""
        if not plan.computing_block_hashes:
            return False
        max_blocks = (request.num_tokens - 1) // self.config.block_size
        return (num_cached_blocks < max_blocks
                and request.block_hashes[num_cached_blocks] in plan.computing_block_hashes)

    def _make_room(self, request: Request, num_new_tokens: int, plan: _StepPlan,
                   cached_block_ids: list[int]) -> bool:
        """Get a sequence slot and blocks for a waiting request (starting with its cached
        prefix); True when allocated.

        Only running requests of strictly lower importance (higher priority number) are
        preempted, fewest first, and only when that is enough.
        """
        max_running = self.config.max_num_seqs * self.config.pipeline_depth
        num_victims_for_slot = max(0, len(self._running) + 1 - max_running)
        manager = self.block_manager
        num_blocks_needed = manager.num_free_blocks_taken(request, num_new_tokens, cached_block_ids)
        num_free_blocks = manager.num_free_blocks
        candidates = sorted(
            (r for r in self._running if r.priority > request.priority and r.req_id not in self._in_flight),
            key=_importance,
            reverse=True,
        )
        victims: list[Request] = []
        for candidate in candidates:
            if len(victims) >= num_victims_for_slot and num_free_blocks >= num_blocks_needed:
                break
            victims.append(candidate)
            # Blocks shared with others stay held; the newcomer's own hits it takes back.
            num_free_blocks += manager.num_blocks_freed_by(candidate, keep=cached_block_ids)
        if len(victims) < num_victims_for_slot or num_free_blocks < num_blocks_needed:
            return False
        for victim in victims:
            self._preempt(victim, plan)
        return manager.allocate_slots(request, num_new_tokens, cached_block_ids)

    def preempt_all_running(self) -> list[str]:
        """After a failed step (a worker group died, its KV cache with it): every running
        request goes back to waiting to recompute its prompt and output so far. Tokens
        already returned stay returned, so callers see no gap and no repeat."""
        plan = _StepPlan(token_budget=0, max_num_seqs=0)
        self._in_flight.clear()  # those steps died with the group
        for request in list(self._running):
            self._preempt(request, plan)
        self.block_manager.reset_prefix_cache()  # the K/V behind it died with the group
        return plan.preempted_req_ids

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        """Free the request's blocks and queue it to recompute everything; keep its output."""
        self._running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        bisect.insort(self._waiting, request, key=_importance)
        plan.remove(request)
        plan.preempted_req_ids.append(request.req_id)
        logger.info(
            "preempted", req_id=request.req_id, num_preemptions=request.num_preemptions,
            num_free_blocks=self.block_manager.num_free_blocks,
        )

    def _num_new_tokens(self, request: Request, token_budget: int, num_cached_tokens: int = 0) -> int:
        num_new_tokens = request.num_tokens - request.num_computed_tokens - num_cached_tokens
        if self.config.long_prefill_chunk is not None:
            num_new_tokens = min(num_new_tokens, self.config.long_prefill_chunk)
        return min(num_new_tokens, token_budget)

    def _make_work(self, request: Request, num_tokens: int) -> SequenceWork:
        start = request.num_computed_tokens
        end = start + num_tokens
        is_sampled = end == request.num_tokens
        # Penalties need the token history; don't ship it for steps that don't sample.
        needs_history = is_sampled and request.sampling.has_penalties
        return SequenceWork(
            req_id=request.req_id,
            token_ids=request.token_ids_slice(start, end),
            start_pos=start,
            block_ids=list(request.block_ids),
            is_sampled=is_sampled,
            sampling=request.worker_sampling,
            num_output_tokens=request.num_output_tokens,
            prompt_token_ids=list(request.prompt_token_ids) if needs_history else [],
            output_token_ids=list(request.output_token_ids) if needs_history else [],
        )

    # -- one step: take the result back ----------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, step_result: StepResult
    ) -> list[RequestOutput]:
        """Record what the step computed and sampled; return one output per changed request.

        Raises WorkerError when the result does not match the batch (wrong step, missing
        or extra sampled tokens).
        """
        batch = scheduler_output.batch
        if step_result.step_id != batch.step_id:
            raise WorkerError(f"result of step {step_result.step_id} for batch {batch.step_id}")
        self._in_flight.difference_update(scheduler_output.num_scheduled_tokens)
        outputs = [self._report_abort(request) for request in self._aborted]
        self._aborted = []
        sampled_tokens = iter(step_result.sampled)
        for work in batch.works:
            sampled = next(sampled_tokens, None) if work.is_sampled else None
            if work.is_sampled and (sampled is None or sampled.req_id != work.req_id):
                raise WorkerError(f"step {batch.step_id}: no sampled token for {work.req_id!r}")
            request = self._requests.get(work.req_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted after schedule(): what the step did for it is moot
            request.num_computed_tokens += len(work.token_ids)
            self.block_manager.register_full_blocks(request)
            if sampled is not None:
                outputs.append(self._append_token(request, sampled))
        if next(sampled_tokens, None) is not None:
            raise WorkerError(f"step {batch.step_id}: more sampled tokens than sampled works")
        return outputs

    def _report_abort(self, request: Request) -> RequestOutput:
        self._forget(request.req_id)
        return RequestOutput(
            request.req_id, [], "", finished=True, finish_reason=FinishReason.ABORT,
            num_cached_tokens=request.num_cached_tokens or 0,
        )

    def _forget(self, req_id: str) -> None:
        del self._requests[req_id]
        self._detokenizers.pop(req_id, None)
        if self.grammars is not None:
            self.grammars.discard(req_id)

    def _append_token(self, request: Request, sampled: SampledToken) -> RequestOutput:
        request.output_token_ids.append(sampled.token_id)
        logprobs = None
        if request.sampling.logprobs is not None:
            logprobs = [TokenLogprobs(sampled.token_id, sampled.logprob, sampled.top_logprobs)]
            request.output_logprobs.extend(logprobs)
        text_delta = self._detokenize_and_check_stop(request, sampled.token_id)
        new_token_ids = [sampled.token_id]
        # Jump-forward (scheduler/grammar.py): text the grammar forces now, appended unsampled.
        forced = self.grammars.forced_tokens(request.req_id) if self.grammars and logprobs is None else []
        for token_id in itertools.takewhile(lambda _: not request.is_finished, forced):
            request.output_token_ids.append(token_id)
            new_token_ids.append(token_id)
            text_delta += self._detokenize_and_check_stop(request, token_id)
        request.output_text += text_delta
        if request.is_finished:
            self._running.remove(request)
            self.block_manager.free(request)
            self._forget(request.req_id)
        return RequestOutput(
            request.req_id, new_token_ids, text_delta, finished=request.is_finished,
            finish_reason=request.finish_reason, stop_reason=request.stop_reason, logprobs=logprobs,
            num_cached_tokens=request.num_cached_tokens or 0)

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
        elif token_id in sampling.stop_token_ids:
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
