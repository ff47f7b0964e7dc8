"""Iteration-level scheduler: which requests compute how many tokens in each step.

Every step, the running decodes of the most important requests present (lowest priority
number: interactive requests beside batch items) go first, then their prefill: the next chunk of
those running, then waiting ones in order (tenants taking turns, fair_share.py), as long as the
token budget, the sequence cap and the KV cache allow; a waiting one takes the slot or the blocks
of a less important running one (preempted). The work of everyone else (decodes, running chunks,
then admissions, most important first) only fills the step up to its latency budget
(step_budget.py), so that batch items never stretch a chat's step; with nothing more important
present, they get the whole budget, in steps short enough for the next chat's first token.

The class is written in three parts, one module each, along a step's path:
- admission.py: the waiting queue, prefix matching, blocks for newcomers, preemption;
- step_composition.py: `schedule()`, building the StepBatch within the step's budget (async
  scheduling, pipelines, grammars and speculative decoding's drafts);
- finishing.py: `update_from_output()`, appending tokens, stop checks, freeing.
This module holds the state they share and the requests' way in and out.
"""

from __future__ import annotations

import bisect
from collections import Counter

from scheduler.admission import Admission, importance
from scheduler.block_manager import BlockManager, cdiv
from scheduler.detokenizer import IncrementalDetokenizer, Tokenizer
from scheduler.fair_share import FairShare
from scheduler.finishing import Finishing
from scheduler.grammar import Grammars
from scheduler.host_tier import HostTier
from scheduler.lora_slots import LoraSlots
from scheduler.request import Request, RequestStatus
from scheduler.speculative.proposers import Proposer
from scheduler.speculative.speculator import Speculator
from scheduler.step_budget import LatencyBudget
from scheduler.step_composition import StepComposition
from scheduler.step_plan import RequestOutput, SchedulerConfig, SchedulerOutput
from shared.errors import InvalidRequestError

__all__ = ["RequestOutput", "Scheduler", "SchedulerConfig", "SchedulerOutput"]


class Scheduler(Admission, StepComposition, Finishing):
    def __init__(self, config: SchedulerConfig, tokenizer: Tokenizer | None = None,
                 grammars: Grammars | None = None, proposer: Proposer | None = None) -> None:
        """Without a tokenizer, outputs carry token ids only (no text, no stop strings); without
        `grammars`, requests with a grammar are refused. `proposer`: speculative decoding's, when
        it is not one the config alone builds (a draft model: the engine builds it)."""
        self.config = config
        self.grammars = grammars
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching)
        # Copies of full blocks in the ranks' host memory (host_tier.py); None: no host tier.
        self.host_tier = None
        if config.num_host_kv_blocks:
            self.host_tier = HostTier(config.num_host_kv_blocks, config.kv_block_bytes)
            self.block_manager.newly_registered = []
        self._loading: dict[int, list[Request]] = {}  # step id -> requests whose prefix it loads
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
        self.speculator = None
        if config.speculative is not None:  # (its rule prices look-ups with the step cost model)
            self.speculator = Speculator(config.speculative, proposer,
                                         step_cost=lambda: self.step_cost,
                                         gives_up_async=config.async_scheduling)
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
        bisect.insort(self._waiting, request, key=importance)

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
