"""Iteration-level scheduler: which requests compute how many tokens in each step.

Every step, the running decodes of the most important requests present (lowest priority
number: interactive requests beside batch items) go first, then their prefill: the next chunk of
those running, then waiting ones in order (tenants taking turns, fair_share.py), as long as the
token budget, the sequence cap and the KV cache allow; a waiting one takes the slot or the blocks
of a less important running one (preempted). The work of everyone else (decodes, running chunks,
then admissions, most important first) only fills the step up to its latency budget
(step_budget.py), so that batch items never stretch a chat's step; with nothing more important
present, they get the whole budget, in steps short enough for the next chat's first token.
When the cache runs out, the least important running request is preempted: its blocks are
freed and it later recomputes its prompt and output from scratch (num_computed_tokens back to
0), its output so far kept.

With prefix caching, a request admitted from the waiting queue starts after the longest
prefix of its tokens whose full blocks are in the cache (block_manager.py); blocks are made
findable once the step that computed them is over, and a preempted request's blocks stay
cached, so it usually resumes from them.

Under pipeline parallelism several steps are in flight at once (the engine submits the next
before the last one's tokens are back). A request in a step still in flight is left out of
the next ones, and never preempted, until that step's output has been taken back: its next
token, and the blocks the step writes, are not known before.

Under async scheduling (one step in flight while the engine plans the next) a request in the
step in flight is scheduled again: a prefill's next chunk, or a decode whose input is the token
that step samples, still on the device (`SequenceWork.is_token_pending`). Blocks cover every
planned position, the pending one included. Stop checks, aborts and preemption act when a step
is taken back, so they may be one step late: what the step ahead computed for a request that
has finished, been aborted or been preempted meanwhile is dropped, never returned nor counted
(its blocks are freed with the request's; the device runs the steps in order, so nothing
handed out again is written by the late step after its new owner).

A request with a grammar is scheduled ahead too when the executor samples late
(`SchedulerConfig.samples_late`): its step's mask is filled once the step in flight's tokens
are accepted (`StepBatch.samples_late`, scheduler/grammar.py). Penalties count the pending token
on the device (workers/sampler.py). A request the step ahead cannot serve waits for its token
as under a pipeline: a grammar when the executor cannot sample late (a Ray group) or with
jump-forward (the forced tokens change its next input), or a pending token that is already its
last; while one of the first kind runs, the engine plans no step ahead
(has_requests_needing_their_token).

Speculative decoding (`SchedulerConfig.speculative`, scheduler/speculative/): a decode whose
tokens are all on the host may carry drafts (`_drafts`), computed in the same step as its last
token and counted in the step's tokens; its blocks cover them, but never at the cost of a
preemption. The step returns how many the workers accepted (`_take_verified`): those and the
target's next token are appended (cut at a stop or max_tokens), the computed length moves past
the accepted ones only, and blocks holding only rejected drafts go back. Such a request needs its
token on the host, like a grammar's: the engine plans no step ahead while one would speculate.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter

from scheduler.block_manager import BlockManager, cdiv, update_block_hashes
from scheduler.detokenizer import IncrementalDetokenizer, Tokenizer
from scheduler.fair_share import FairShare
from scheduler.grammar import Grammars
from scheduler.lora_slots import LoraSlots
from scheduler.prompt_logprobs import prompt_logprob_targets, prompt_logprobs_to_send, take_prompt_logprobs
from scheduler.request import BATCH_PRIORITY, FinishReason, Request, RequestStatus, TokenLogprobs
from scheduler.speculative.proposers import Proposer
from scheduler.speculative.speculator import Speculator
from scheduler.step_budget import LatencyBudget
from scheduler.step_cost import StepCost
from scheduler.step_plan import RequestOutput, SchedulerConfig, SchedulerOutput, StepPlan
from shared.errors import InvalidRequestError, WorkerError
from shared.logging import get_logger
from shared.step import SampledToken, SequenceWork, StepBatch, StepResult

__all__ = ["RequestOutput", "Scheduler", "SchedulerConfig", "SchedulerOutput"]

logger = get_logger(__name__)


def _importance(request: Request) -> tuple[int, float]:
    """Sort key: most important first (lower priority number, then earlier arrival)."""
    return (request.priority, request.arrival_time)


def _less_important_order(request: Request) -> tuple[int, bool, float]:
    """Sort key of the work a step's budget caps: by priority, decodes first (they hold their
    KV blocks already; finishing them frees slots), the decode that ran longest ago first (a
    decode the cap left out goes first next time), prompts in arrival order."""
    is_prefill = request.num_tokens - request.num_computed_tokens > 1
    return (request.priority, is_prefill, request.arrival_time if is_prefill else request.last_scheduled_step)


class Scheduler:
    def __init__(self, config: SchedulerConfig, tokenizer: Tokenizer | None = None,
                 grammars: Grammars | None = None, proposer: Proposer | None = None) -> None:
        """Without a tokenizer, outputs carry token ids only (no text, no stop strings); without
        `grammars`, requests with a grammar are refused. `proposer`: speculative decoding's, when
        it is not one the config alone builds (a draft model: the engine builds it)."""
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
        # Hashes of the full blocks that steps in flight compute (findable once taken back), with
        # the number of steps computing each: a newcomer waits for them as for the current step's.
        self._computing_in_flight: Counter[bytes] = Counter()
        self._aborted: list[Request] = []  # aborted since the last update_from_output
        self._freed_req_ids: list[str] = []  # blocks freed since the last batch: the next one says so
        self._next_step_id = 0
        # How long a step may be beside more important work, from what steps cost (step_budget.py);
        # the engine feeds it the time of every step it runs (observe_step).
        self.latency_budget = LatencyBudget(config.itl_target_ms, config.itl_slowdown)
        # When set, only requests with stop strings are detokenized here (their text decides when
        # they stop); the caller turns the others' tokens into text off the step's critical path.
        self.text_for_stop_strings_only = False
        # Speculative decoding: decodes may carry drafts that the step verifies (_drafts).
        self.speculator = Speculator(config.speculative, proposer) if config.speculative is not None else None
        self._drafting: set[str] = set()  # requests whose step in flight carries drafts
        # The adapters served and their slots (scheduler/lora_slots.py); None: no adapters.
        self.lora_slots = LoraSlots(config.max_loras) if config.max_loras else None

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
        self._free_blocks(request)
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
        if request.lora is not None and self.lora_slots is None:
            raise InvalidRequestError("this scheduler serves no LoRA adapters", param="model")
        if request.sampling.stop and self._tokenizer is None:
            raise InvalidRequestError(
                "stop strings need a scheduler with a tokenizer", param="stop"
            )

    # -- one step: schedule ----------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step: running decodes, then the prefill of the most important requests present
        (running, then waiting ones admitted, preempting less important ones for room), then the
        prefill of the others, within the step's latency budget (scheduler/step_budget.py)."""
        # (Or one present a moment ago: step_budget.py, RecentPriority.)
        top = self.latency_budget.recent_top.top(self._most_important_priority())
        token_budget = self.config.max_num_batched_tokens
        if top is not None and top >= BATCH_PRIORITY:  # batch work alone: short steps, for the next chat
            token_budget = self.latency_budget.batch_step_tokens(token_budget, len(self._running))
        plan = StepPlan(token_budget=token_budget, max_num_seqs=self._step_seq_budget())
        plan.top_priority = top
        plan.can_speculate = self.speculator is not None and self.speculator.step_allows(len(self._running))
        if plan.can_speculate and self.speculator.batches_proposals:  # (n-gram: nothing to do ahead)
            candidates = [r for r in self._running if self._may_draft(r)]
            self.speculator.prepare(candidates, [self._max_drafts(r, plan.token_budget) for r in candidates])
        if self.lora_slots is not None:
            self.lora_slots.count_running([r.lora for r in self._running if r.lora is not None])
        less_important = self._schedule_running(plan, top)
        # Blocks just freed by preemption are for the running requests that needed them;
        # admitting new ones now would only preempt again.
        admits = not plan.preempted_req_ids and self._schedule_waiting(plan, top, capped=False)
        if less_important or (admits and self._waiting):
            # Relative to the most important work alone: less important decodes (already in
            # the step) take their share of the budget rather than raise it.
            plan.step_token_cap = self.latency_budget.step_tokens(
                plan.num_top_tokens, self.config.max_num_batched_tokens)
            self._schedule_less_important(plan, less_important, admits)
        scheduled = [self._requests[req_id] for req_id in plan.num_scheduled_tokens]
        works = [self._make_work(request, plan.num_scheduled_tokens[request.req_id],
                                 plan.draft_token_ids.get(request.req_id, ())) for request in scheduled]
        self._drafting.update(plan.draft_token_ids)
        batch = StepBatch(step_id=self._next_step_id, works=works)
        if self.lora_slots is not None:
            batch.lora_loads = self.lora_slots.take_loads()
        if works:  # a batch without works never reaches the runners: its frees wait for the next
            batch.freed_req_ids, self._freed_req_ids = self._freed_req_ids, []
        if self.grammars is not None:  # the runner fills it once the forward runs (shared/step.py)
            batch.mask_filler = self.grammars.mask_filler(works)
            # A constrained row whose input is the step in flight's token: its matcher needs that
            # token first, so the step is sampled once the step in flight is taken back.
            batch.samples_late = batch.mask_filler is not None and any(
                w.is_token_pending and w.req_id in self.grammars for w in works)
        self._next_step_id += 1
        for request, work in zip(scheduled, works, strict=True):
            request.last_scheduled_step = batch.step_id
            request.num_in_flight_tokens += len(work.token_ids)
            request.num_pending_tokens += work.is_sampled
        self._computing_in_flight.update(plan.computing_block_hashes)
        return SchedulerOutput(batch, plan.num_scheduled_tokens, plan.preempted_req_ids,
                               [(request, request.num_preemptions) for request in scheduled],
                               plan.computing_block_hashes, plan.step_token_cap,
                               plan.num_top_tokens, plan.was_capped)

    @property
    def step_cost(self) -> StepCost:
        """The step cost model the latency budget learns (one object: the budget's own)."""
        return self.latency_budget.cost

    def observe_step(self, output: SchedulerOutput, ms: float) -> None:
        """What a step took (from the engine), for the latency budget (step_budget.py)."""
        self.latency_budget.observe(output.batch.num_tokens, output.num_top_tokens, ms,
                                    was_capped=output.was_capped, limit=self.config.max_num_batched_tokens)

    def _most_important_priority(self) -> int | None:
        """The lowest priority number among running and waiting requests (None: there are none):
        their prefill goes first and uncapped; everyone else's within the latency budget."""
        top = min((request.priority for request in self._running), default=None)
        if self._waiting and (top is None or self._waiting[0].priority < top):
            top = self._waiting[0].priority
        return top

    def _step_seq_budget(self) -> int:
        """Sequences this step may take: all of max_num_seqs, but for a pipeline a 1/depth share
        of the requests there are (rounded up), so that the steps in flight split them evenly."""
        depth = self.config.pipeline_depth
        if depth == 1:
            return self.config.max_num_seqs
        num_requests = len(self._running) + len(self._waiting)
        return max(1, min(self.config.max_num_seqs, -(-num_requests // depth)))

    def _schedule_running(self, plan: StepPlan, top: int | None) -> list[Request]:
        """Every running decode, and the prefill chunks of the running requests of priority
        `top`; returns the others still prefilling, most important first, for later in the step."""
        # Decodes first: a request still prefilling gets what they leave, so a long prompt
        # never holds back the decodes of others for more than its current chunk.
        by_decodes_first = sorted(
            self._running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1
        )
        less_important: list[Request] = []
        for request in by_decodes_first:
            if not plan.has_seq_room:
                break  # the rest go with the next step (a pipeline's share)
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted for another request earlier in this loop
            if request.num_in_flight_tokens and not self._can_schedule_ahead(request):
                continue  # in a step in flight: its next step waits for that one's token
            if request.priority != top:
                less_important.append(request)  # within the step's budget, later
                continue
            self._schedule_running_request(request, plan, plan.token_budget)
        less_important.sort(key=_less_important_order)
        return less_important

    def _schedule_less_important(self, plan: StepPlan, prefills: list[Request], admits: bool) -> None:
        """Within the step's cap, in priority order: the running requests' decodes and prefill
        chunks (`_less_important_order`), each after the waiting requests more important than it;
        then the rest of the waiting ones. No admission once this step preempted (admitting would only preempt
        again) or a waiting request is stuck (strict order)."""
        admitted_until: int | None = None  # the priority up to which waiting ones were admitted
        for request in prefills:
            if admits and request.priority != admitted_until:
                admitted_until = request.priority
                admits = not plan.preempted_req_ids and self._schedule_waiting(
                    plan, request.priority - 1, capped=True)
            if not plan.has_seq_room or plan.capped_budget <= 0:
                plan.was_capped = True
                return
            if request.status is RequestStatus.RUNNING:  # (not preempted for a newcomer meanwhile)
                self._schedule_running_request(request, plan, plan.capped_budget)
        if admits and not plan.preempted_req_ids:
            self._schedule_waiting(plan, None, capped=True)
        plan.was_capped = plan.was_capped or plan.capped_budget <= 0

    def _schedule_running_request(self, request: Request, plan: StepPlan, token_budget: int) -> None:
        num_new_tokens = self._num_new_tokens(request, token_budget)
        if num_new_tokens == 0:
            return
        drafts = self._drafts(request, num_new_tokens, token_budget, plan)
        # Drafts only where their slots are free: never a preemption for a guess.
        if drafts and self.block_manager.allocate_slots(request, 1 + len(drafts)):
            plan.add(request, 1 + len(drafts))  # drafted tokens count as the step's tokens
            plan.draft_token_ids[request.req_id] = drafts
            return
        # Blocks for every planned position: those of the step in flight, then these.
        num_slots = request.num_in_flight_tokens + num_new_tokens
        while not self.block_manager.allocate_slots(request, num_slots):
            victim = max((r for r in self._running if self._can_preempt(r)),
                         key=_importance)  # `request` itself at worst
            self._preempt(victim, plan)
            if victim is request:
                return
        plan.add(request, num_new_tokens)
        self._note_computing(request, num_new_tokens, plan)

    def _drafts(self, request: Request, num_new_tokens: int, token_budget: int, plan: StepPlan) -> list[int]:
        """Drafts for a decode whose tokens are all on the host (none pending nor in flight), when
        this step allows speculation; never past max_tokens, the model's window or the budget."""
        if not plan.can_speculate or num_new_tokens != 1 or not self._may_draft(request):
            return []
        return self.speculator.propose(request, self._max_drafts(request, token_budget))

    @staticmethod
    def _may_draft(request: Request) -> bool:
        """A decode whose tokens are all on the host: none pending, none in a step in flight."""
        return (not request.num_in_flight_tokens and not request.num_pending_tokens
                and request.num_computed_tokens == request.num_tokens - 1)

    def _max_drafts(self, request: Request, token_budget: int) -> int:
        return min(token_budget - 1, request.sampling.max_tokens - request.num_output_tokens - 1,
                   self._max_num_tokens - request.num_tokens - 1)

    def has_requests_needing_their_token(self) -> bool:
        """Whether a running request cannot be scheduled ahead (a grammar whose mask needs its
        token on the host before the step launches: `_needs_its_token`; a request that would
        speculate, whose drafts come from its tokens on the host). The engine then plans
        the next step only once this one's tokens are back, so such a request runs in every
        step, not every other one."""
        if self._drafting or (self.speculator is not None and self.speculator.step_allows(len(self._running))
                              and any(self.speculator.wants_to_speculate(r) for r in self._running)):
            return True
        return any(self._needs_its_token(r) for r in self._running if r.sampling.grammar is not None)

    def _needs_its_token(self, request: Request) -> bool:
        """A grammar's request needs its last token on the host before its next step is launched
        unless the executor samples late; with jump-forward always (the tokens its grammar forces
        after that token are the next step's input)."""
        if request.sampling.grammar is None:
            return False
        return not self.config.samples_late or (self.grammars is not None and self.grammars.jump_forward)

    def _can_schedule_ahead(self, request: Request) -> bool:
        """Whether a request in the step in flight can be in the next one too (async scheduling)."""
        if not self.config.async_scheduling or self._needs_its_token(request):
            return False
        if request.req_id in self._drafting:
            return False  # its next input is the verify's outcome, known on the host only
        if not request.num_pending_tokens:
            return True  # a prefill's next chunk: its tokens are known
        # The pending token may already be its last: a step for the one after would be wasted,
        # and could reach past the model's window.
        return (request.num_output_tokens + request.num_pending_tokens < request.sampling.max_tokens
                and request.num_tokens + request.num_pending_tokens < self._max_num_tokens)

    def _can_preempt(self, request: Request) -> bool:
        """Under a pipeline a request in a step in flight stays (its stages may still write its
        K/V); under async scheduling the step in flight's result is dropped, as for an abort."""
        return self.config.async_scheduling or not request.num_in_flight_tokens

    def _schedule_waiting(self, plan: StepPlan, until: int | None, *, capped: bool) -> bool:
        """Admit waiting requests in order, those of priority `until` or more important (None:
        all), their prefill within the step's cap when `capped`. True when every one of them was
        admitted (none is stuck: less important ones may follow)."""
        # Strict priorities; tenants take turns inside one (scheduler/fair_share.py).
        for request in self._fair_share.order(self._waiting):
            if until is not None and request.priority > until:
                return True
            token_budget = plan.capped_budget if capped else plan.token_budget
            if token_budget <= 0:
                return False
            if self.config.pipeline_depth > 1 and not plan.has_seq_room:
                return False  # this step's share is taken; the next step in flight takes the next ones
            if request.req_id in plan.preempted_req_ids:
                return False  # just made room for a more important one; not back in this step
            if self.lora_slots is not None and not self.lora_slots.can_run(request.lora):
                continue  # every slot holds a running request's adapter: it waits for one to free
            if request.sampling.prompt_logprobs is not None:
                cached_block_ids = []  # cached positions have no logits: it computes its whole prompt
            else:
                cached_block_ids = self.block_manager.find_cached_prefix(request)
                if self._prefix_is_being_computed(request, len(cached_block_ids), plan):
                    # Wait one step and take those blocks from the cache, rather than compute them
                    # twice (a burst of chats with one system prompt computes it once).
                    return False
            num_new_tokens = self._num_new_tokens(
                request, token_budget, len(cached_block_ids) * self.config.block_size)
            if not self._make_room(request, num_new_tokens, plan, cached_block_ids):
                return False  # strict order: later requests do not jump ahead of a stuck one
            self.block_manager.record_first_admission(request)
            self._waiting.remove(request)
            self._fair_share.started(request)
            request.status = RequestStatus.RUNNING
            self._running.append(request)
            if self.lora_slots is not None:
                self.lora_slots.started(request.lora)
            plan.add(request, num_new_tokens)
            self._note_computing(request, num_new_tokens, plan)
        return True

    def _note_computing(self, request: Request, num_new_tokens: int, plan: StepPlan) -> None:
        if num_new_tokens <= 1 or not self.config.enable_prefix_caching:
            return  # a decode's block is its own output: not worth waiting for
        hashes = update_block_hashes(request, self.config.block_size)
        first = request.num_planned_tokens // self.config.block_size
        end = (request.num_planned_tokens + num_new_tokens) // self.config.block_size
        plan.computing_block_hashes.update(hashes[first:end])

    def _prefix_is_being_computed(self, request: Request, num_cached_blocks: int, plan: StepPlan) -> bool:
        """Whether the request's first block not in the cache is computed by another, in this step
        or in one in flight."""
        if not plan.computing_block_hashes and not self._computing_in_flight:
            return False
        max_blocks = (request.num_tokens - 1) // self.config.block_size
        if num_cached_blocks >= max_blocks:
            return False
        block_hash = request.block_hashes[num_cached_blocks]
        return block_hash in plan.computing_block_hashes or block_hash in self._computing_in_flight

    def _make_room(self, request: Request, num_new_tokens: int, plan: StepPlan,
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
            (r for r in self._running if r.priority > request.priority and self._can_preempt(r)),
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
        plan = StepPlan(token_budget=0, max_num_seqs=0)
        self._computing_in_flight.clear()
        for request in list(self._running):  # their steps in flight died with the group
            self._preempt(request, plan)
        self.block_manager.reset_prefix_cache()  # the K/V behind it died with the group
        if self.lora_slots is not None:
            self.lora_slots.forget_slots()  # so did the adapters in the runners' slots
        return plan.preempted_req_ids

    def _free_blocks(self, request: Request) -> None:
        """Its blocks back to the pool; the next batch tells the runners (their block-table rows)."""
        self.block_manager.free(request)
        self._freed_req_ids.append(request.req_id)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Free the request's blocks and queue it to recompute everything; keep its output."""
        self._running.remove(request)
        self._free_blocks(request)
        request.num_computed_tokens = 0
        request.num_in_flight_tokens = request.num_pending_tokens = 0  # their results are dropped
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
        num_known = request.num_tokens + request.num_pending_tokens  # a pending token is known next step
        num_new_tokens = num_known - request.num_planned_tokens - num_cached_tokens
        if self.config.long_prefill_chunk is not None:
            num_new_tokens = min(num_new_tokens, self.config.long_prefill_chunk)
        return min(num_new_tokens, token_budget)

    def _make_work(self, request: Request, num_tokens: int, drafts: list[int] | tuple = ()) -> SequenceWork:
        start = request.num_planned_tokens
        end = start + num_tokens - len(drafts)  # drafts follow the known tokens
        # A step ahead of a pending token computes that token alone (the schedule allows one).
        is_token_pending = end > request.num_tokens
        is_sampled = end == request.num_tokens + request.num_pending_tokens
        # Penalties need the token history; don't ship it for steps that don't sample.
        needs_history = is_sampled and request.sampling.has_penalties
        return SequenceWork(
            req_id=request.req_id,
            token_ids=[0] if is_token_pending else request.token_ids_slice(start, end) + list(drafts),
            start_pos=start,
            block_ids=list(request.block_ids),
            is_sampled=is_sampled,
            sampling=request.worker_sampling,
            # With a seed this picks the random stream: the pending tokens come before this one.
            num_output_tokens=request.num_output_tokens + request.num_pending_tokens,
            prompt_token_ids=list(request.prompt_token_ids) if needs_history else [],
            output_token_ids=list(request.output_token_ids) if needs_history else [],
            is_token_pending=is_token_pending,
            rope_offset=request.rope_offset,
            prompt_logprob_ids=prompt_logprob_targets(request, start, end),
            num_draft_tokens=len(drafts),
            lora_slot=self.lora_slots.slot_for(request.lora) if self.lora_slots is not None else 0,
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
        self._computing_in_flight.subtract(scheduler_output.computing_block_hashes)
        self._computing_in_flight += Counter()  # drops the hashes no step computes any more
        outputs = [self._report_abort(request) for request in self._aborted]
        self._aborted = []
        sampled_tokens = iter(step_result.sampled)
        scheduled = scheduler_output.scheduled_requests or [
            (self._requests.get(w.req_id), None) for w in batch.works]  # an output built by hand (tests)
        for work, (request, num_preemptions) in zip(batch.works, scheduled, strict=True):
            sampled = next(sampled_tokens, None) if work.is_sampled else None
            if work.is_sampled and (sampled is None or sampled.req_id != work.req_id):
                raise WorkerError(f"step {batch.step_id}: no sampled token for {work.req_id!r}")
            if work.num_draft_tokens:
                self._drafting.discard(work.req_id)
            if request is None or request.status is not RequestStatus.RUNNING or (
                    num_preemptions is not None and request.num_preemptions != num_preemptions):
                # Aborted, finished or preempted after schedule(): what the step did for it is moot
                # (a token past a stop, an abort or max_tokens is dropped here, never counted).
                continue
            if work.num_draft_tokens:
                outputs.append(self._take_verified(request, work, sampled))
                continue
            if work.prompt_logprob_ids:
                take_prompt_logprobs(request, work, step_result)
            request.num_computed_tokens += len(work.token_ids)
            request.num_in_flight_tokens -= len(work.token_ids)
            self.block_manager.register_full_blocks(request)
            if sampled is not None:
                request.num_pending_tokens -= 1
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
