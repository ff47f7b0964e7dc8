"""Step composition: `schedule()` builds the next StepBatch within the step's budget.

Under pipeline parallelism several steps are in flight at once (the engine submits the next
before the last one's tokens are back). A request in a step still in flight is left out of
the next ones, and never preempted, until that step's output has been taken back: its next
token, and the blocks the step writes, are not known before.

Under async scheduling (one step in flight while the engine plans the next) a request in the
step in flight is scheduled again: a prefill's next chunk, or a decode whose input is the token
that step samples, still on the device (`SequenceWork.is_token_pending`). Blocks cover every
planned position, the pending one included. Stop checks, aborts and preemption act when a step
is taken back, so they may be one step late (finishing.py).

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
preemption. The step returns how many the workers accepted (finishing.py).

A part of `Scheduler` (scheduler.py), whose state it reads and changes.
"""

from __future__ import annotations

from scheduler.admission import importance
from scheduler.prompt_logprobs import prompt_logprob_targets
from scheduler.request import BATCH_PRIORITY, Request, RequestStatus
from scheduler.step_cost import StepCost
from scheduler.step_plan import SchedulerOutput, StepPlan
from shared.step import SequenceWork, StepBatch


def _less_important_order(request: Request) -> tuple[int, bool, float]:
    """Sort key of the work a step's budget caps: by priority, decodes first (they hold their
    KV blocks already; finishing them frees slots), the decode that ran longest ago first (a
    decode the cap left out goes first next time), prompts in arrival order."""
    is_prefill = request.num_tokens - request.num_computed_tokens > 1
    return (request.priority, is_prefill, request.arrival_time if is_prefill else request.last_scheduled_step)


class StepComposition:
    def schedule(self) -> SchedulerOutput:
        """The next step: running decodes, then the prefill of the most important requests present
        (running, then waiting ones admitted, preempting less important ones for room), then the
        prefill of the others, within the step's latency budget (scheduler/step_budget.py)."""
        # (Or one present a moment ago: step_budget.py, RecentPriority.)
        top = self.latency_budget.recent_top.top(self._most_important_priority())
        token_budget = self.config.max_num_batched_tokens
        if top is not None and top >= BATCH_PRIORITY:  # batch work alone: short steps, for the next chat
            token_budget = self.latency_budget.batch_step_tokens(
                token_budget, len(self._running), sum(r.num_planned_tokens + 1 for r in self._running))
        plan = StepPlan(token_budget=token_budget, max_num_seqs=self._step_seq_budget())
        if self.host_tier is not None:  # blocks filled since the last step go to the host
            self.host_tier.plan_stores(self.block_manager)
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
            cap = self.latency_budget.cap(plan.num_top_tokens, plan.num_top_kv_tokens,
                                          self.config.max_num_batched_tokens)
            plan.step_token_cap, plan.time_cap = cap.tokens, cap
            self._schedule_less_important(plan, less_important, admits)
        scheduled = [self._requests[req_id] for req_id in plan.num_scheduled_tokens]
        works = [self._make_work(request, plan.num_scheduled_tokens[request.req_id],
                                 plan.draft_token_ids.get(request.req_id, ())) for request in scheduled]
        self._drafting.update(plan.draft_token_ids)
        batch = StepBatch(step_id=self._next_step_id, works=works)
        if self.lora_slots is not None:
            batch.lora_loads = self.lora_slots.take_loads()
        if self.host_tier is not None:
            batch.kv_stores, batch.kv_loads = self.host_tier.take_copies(batch.step_id)
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
                               plan.num_top_tokens, plan.was_capped, top_priority=top,
                               num_kv_tokens=plan.num_kv_tokens, num_top_kv_tokens=plan.num_top_kv_tokens,
                               predicted_ms=self.step_cost.predict(batch.num_tokens, plan.num_kv_tokens)
                               if works else None)

    @property
    def step_cost(self) -> StepCost:
        """The step cost model the latency budget learns (one object: the budget's own)."""
        return self.latency_budget.cost

    def observe_step(self, output: SchedulerOutput, ms: float) -> None:
        """What a step took (from the engine), for the latency budget (step_budget.py)."""
        self.latency_budget.observe(output.batch.num_tokens, output.num_top_tokens, ms,
                                    was_capped=output.was_capped, limit=self.config.max_num_batched_tokens,
                                    kv_tokens=output.num_kv_tokens, top_kv_tokens=output.num_top_kv_tokens)

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
            if request.loading_step_id is not None:
                continue  # its prefix is being loaded from the host tier
            if request.num_in_flight_tokens and not self._can_schedule_ahead(request):
                continue  # in a step in flight: its next step waits for that one's token
            if request.priority != top:
                less_important.append(request)  # within the step's budget, later
                continue
            self._schedule_running_request(request, plan, plan.token_budget)
        less_important.sort(key=_less_important_order)
        return less_important

    def _schedule_less_important(self, plan: StepPlan, prefills: list[Request], admits: bool) -> None:
        """Within the step's cap of time (step_budget.py), cheapest work first within a priority:
        the running requests' decodes, then their prefill chunks (`_less_important_order`), each
        after the waiting requests more important than it; then the rest of the waiting ones, their
        chunks cut to the time left. No admission once this step preempted (admitting would only
        preempt again) or a waiting request is stuck (strict order)."""
        admitted_until: int | None = None  # the priority up to which waiting ones were admitted
        for request in prefills:
            if admits and request.priority != admitted_until:
                admitted_until = request.priority
                admits = not plan.preempted_req_ids and self._schedule_waiting(
                    plan, request.priority - 1, capped=True)
            if not plan.has_seq_room or plan.capped_budget <= 0:
                plan.was_capped = True
                return
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted for a newcomer meanwhile
            wanted = self._num_new_tokens(request, plan.capped_budget)
            if wanted == 1 and plan.can_speculate and self._may_draft(request):
                # A decode that may speculate asks for room for its drafts too: the time cap cuts
                # them, not a one-token request that leaves none.
                wanted += min(self.speculator.config.num_speculative_tokens,
                              max(0, self._max_drafts(request, plan.capped_budget)))
            token_budget = plan.capped_tokens(request.num_planned_tokens, wanted)
            if token_budget <= 0:  # not even its first token within the time left: the step is full
                plan.was_capped = True
                return
            self._schedule_running_request(request, plan, token_budget)
            if token_budget < wanted:
                plan.was_capped = True  # (a chunk cut to the time left)
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
                         key=importance)  # `request` itself at worst
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
