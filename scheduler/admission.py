"""Admission: waiting requests into the running set, with their blocks; preemption.

With prefix caching, a request admitted from the waiting queue starts after the longest
prefix of its tokens whose full blocks are in the cache (block_manager.py); blocks are made
findable once the step that computed them is over, and a preempted request's blocks stay
cached, so it usually resumes from them.

When the cache runs out, the least important running request is preempted: its blocks are
freed and it later recomputes its prompt and output from scratch (num_computed_tokens back to
0), its output so far kept.

A part of `Scheduler` (scheduler.py), whose state it reads and changes.
"""

from __future__ import annotations

import bisect

from scheduler.block_manager import update_block_hashes
from scheduler.request import Request, RequestStatus
from scheduler.step_plan import StepPlan
from shared.logging import get_logger

logger = get_logger("scheduler.scheduler")


def importance(request: Request) -> tuple[int, float]:
    """Sort key: most important first (lower priority number, then earlier arrival)."""
    return (request.priority, request.arrival_time)


class Admission:
    def _can_preempt(self, request: Request) -> bool:
        """Under a pipeline a request in a step in flight stays (its stages may still write its
        K/V); under async scheduling the step in flight's result is dropped, as for an abort."""
        if request.loading_step_id is not None:
            return False  # its load may still write its blocks: they are not to be handed out
        return self.config.async_scheduling or not request.num_in_flight_tokens

    def _schedule_waiting(self, plan: StepPlan, until: int | None, *, capped: bool) -> bool:
        """Admit waiting requests in order, those of priority `until` or more important (None:
        all), their prefill within the step's cap when `capped`. True when every one of them was
        admitted (none is stuck: less important ones may follow)."""
        # Strict priorities; tenants take turns inside one (scheduler/fair_share.py).
        for request in self._fair_share.order(self._waiting):
            if until is not None and request.priority > until:
                return True
            token_budget = plan.capped_tokens() if capped else plan.token_budget
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
                host_slots = self._host_hits(request, len(cached_block_ids))
                if host_slots:
                    # Its next blocks come from the host tier: loaded by this step, computed after.
                    num_load_tokens = len(host_slots) * self.config.block_size
                    if not self._make_room(request, num_load_tokens, plan, cached_block_ids):
                        return False
                    self._start_load(request, len(cached_block_ids), host_slots, plan)
                    self._start(request, num_host_tokens=num_load_tokens)
                    continue
            num_cached_tokens = len(cached_block_ids) * self.config.block_size
            if capped:  # its chunk cut to the time left, from after its cached prefix (step_budget.py)
                token_budget = plan.capped_tokens(num_cached_tokens, token_budget)
                if token_budget <= 0:
                    return False
            num_new_tokens = self._num_new_tokens(request, token_budget, num_cached_tokens)
            if not self._make_room(request, num_new_tokens, plan, cached_block_ids):
                return False  # strict order: later requests do not jump ahead of a stuck one
            self._start(request)
            plan.add(request, num_new_tokens)
            self._note_computing(request, num_new_tokens, plan)
        return True

    def _start(self, request: Request, num_host_tokens: int = 0) -> None:
        """A waiting request, its blocks allocated, joins the running ones."""
        self.block_manager.record_first_admission(request, num_host_tokens)
        if num_host_tokens and self.host_tier is not None:
            self.host_tier.counters.num_hit_tokens += num_host_tokens
        self._waiting.remove(request)
        self._fair_share.started(request)
        request.status = RequestStatus.RUNNING
        self._running.append(request)
        if self.lora_slots is not None:
            self.lora_slots.started(request.lora)

    def _host_hits(self, request: Request, num_cached_blocks: int) -> list[int]:
        """The host slots holding the request's blocks after its `num_cached_blocks` GPU hits (at
        most up to its last token's block, which is computed); [] without a host tier."""
        if self.host_tier is None:
            return []
        max_blocks = (request.num_tokens - 1) // self.config.block_size
        return self.host_tier.match(request.block_hashes[num_cached_blocks:max_blocks])

    def _start_load(self, request: Request, num_cached_blocks: int, host_slots: list[int],
                    plan: StepPlan) -> None:
        """The request's new blocks after its GPU hits are loaded from `host_slots` by this step;
        it counts them computed, and runs once the step is back (finishing.py, _loads_done)."""
        end = num_cached_blocks + len(host_slots)
        self.host_tier.load(host_slots, request.block_ids[num_cached_blocks:end], self.block_manager)
        request.num_computed_tokens = end * self.config.block_size
        request.loading_step_id = self._next_step_id
        self._loading.setdefault(self._next_step_id, []).append(request)
        # A newcomer with the same prefix waits for these blocks rather than load them again.
        plan.computing_block_hashes.update(request.block_hashes[num_cached_blocks:end])

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
        if num_victims_for_slot == 0 and num_free_blocks >= num_blocks_needed:
            # Room without preempting (the common case): no scan of every running request,
            # which, done for each admission, made a step's admissions quadratic in its batch.
            return manager.allocate_slots(request, num_new_tokens, cached_block_ids)
        candidates = sorted(
            (r for r in self._running if r.priority > request.priority and self._can_preempt(r)),
            key=importance,
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
        if self.host_tier is not None:  # the host pools died with the group too
            self.host_tier.reset(self.block_manager)
        self._loading.clear()
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
        request.loading_step_id = None  # (only a dead group's: a loading request is not preempted)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        bisect.insort(self._waiting, request, key=importance)
        plan.remove(request)
        plan.preempted_req_ids.append(request.req_id)
        logger.info(
            "preempted", req_id=request.req_id, num_preemptions=request.num_preemptions,
            num_free_blocks=self.block_manager.num_free_blocks,
        )
