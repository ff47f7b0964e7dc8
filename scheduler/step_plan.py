"""What one step of the scheduler is made of: its config, the plan schedule() builds, and what
it hands out (the batch for the workers, one output per changed request).

Under async scheduling (`SchedulerConfig.async_scheduling`) the engine submits step n+1 before
it takes step n back, so a step's output keeps the Request objects it scheduled, with each one's
preemption count: a request preempted, finished or aborted while its step was in flight has
that step's result dropped (scheduler.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import FinishReason, Request, TokenLogprobs
from scheduler.step_budget import DEFAULT_SLOWDOWN, StepCap
from shared.speculative import SpeculativeConfig
from shared.step import StepBatch


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
    # Async scheduling (one step in flight while the next is planned): a request whose step is
    # in flight is scheduled again, its next input the token that step samples (still on the
    # device). Only with pipeline_depth 1: a pipeline's steps in flight hold different requests.
    async_scheduling: bool = False
    # With async scheduling: whether the executor can sample a step late (StepBatch.samples_late;
    # the in-process runner can, a Ray group's ranks run each step to its end). Then a request with
    # a grammar is scheduled ahead like any other; otherwise it waits for its token.
    samples_late: bool = False
    # Beside more important work (an interactive request beside batch items, a higher priority
    # beside a lower one), a step's less important prefill fills it only up to a latency budget
    # (scheduler/step_budget.py): this many milliseconds; None: itl_slowdown times a step of the
    # most important work alone, as the step cost model predicts it; 0: no budget.
    itl_target_ms: float | None = None
    itl_slowdown: float = DEFAULT_SLOWDOWN
    # Speculative decoding (scheduler/speculative/): None: no request speculates.
    speculative: SpeculativeConfig | None = None
    # LoRA adapters: how many may share a step (the runners' slots); 0: no adapters served.
    max_loras: int = 0
    # The host tier under the prefix cache (scheduler/host_tier.py): its blocks (0: none), and one
    # block's bytes over every rank (for the metrics).
    num_host_kv_blocks: int = 0
    kv_block_bytes: int = 0

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
        if self.itl_target_ms is not None and self.itl_target_ms < 0:
            raise ValueError(f"itl_target_ms must be >= 0, got {self.itl_target_ms}")
        if not self.itl_slowdown >= 1:
            raise ValueError(f"itl_slowdown must be >= 1, got {self.itl_slowdown}")
        if self.num_host_kv_blocks and not self.enable_prefix_caching:
            raise ValueError("the host KV tier sits under the prefix cache: it needs prefix caching on")
        if self.async_scheduling and self.pipeline_depth > 1:
            raise ValueError("async_scheduling needs pipeline_depth 1 (a pipeline overlaps its steps)")


@dataclass
class SchedulerOutput:
    batch: StepBatch
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens computed this step, batch order
    preempted_req_ids: list[str]  # preempted during this schedule() call
    # Batch order: (the request, its num_preemptions when scheduled). The result of a request
    # preempted since (and perhaps admitted again) belongs to the old run and is dropped.
    scheduled_requests: list[tuple[Request, int]] = field(default_factory=list)
    # Hashes of the full blocks this step's prefills compute, findable once it is taken back.
    computing_block_hashes: set[bytes] = field(default_factory=set)
    # The most tokens the step could hold once less important prefill joined (step_budget.py);
    # None: nothing less important to cap.
    step_token_cap: int | None = None
    num_top_tokens: int = 0  # tokens of the most important priority present
    was_capped: bool = False  # the cap held less important work back
    top_priority: int | None = None  # the priority whose work the step protected
    num_kv_tokens: int = 0  # context tokens the step's rows read (StepPlan.num_kv_tokens)
    num_top_kv_tokens: int = 0  # of them, the most important priority's rows'
    # What the step cost model predicted for the step when it was planned (None: nothing timed yet),
    # beside what the engine measures (scheduler/step_trace.py).
    predicted_ms: float | None = None

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
    # The whole prompt's logprobs, on the output of the first token (sampling.prompt_logprobs
    # set): per prompt token [token_id, logprob, top], the first one's logprob None.
    prompt_logprobs: list[list] | None = None
    # A pooling request's embedding (float32 bytes), on its one, finished output
    # (scheduler/pooling.py); its new_token_ids are then empty.
    embedding: bytes | None = None


@dataclass
class StepPlan:
    """What schedule() has decided so far; preemption can take a decision back."""

    token_budget: int
    max_num_seqs: int  # sequences this step may take
    # The most tokens the step may hold once less important prefill joins (step_budget.py);
    # None: no such cap (nothing more important present, or not yet computed).
    step_token_cap: int | None = None
    # The time less important work must fit in, with that cap (step_budget.py); None: tokens only.
    time_cap: StepCap | None = None
    num_tokens: int = 0  # scheduled so far
    # Context tokens the rows scheduled so far read (each row: the positions it attends to, its
    # own included): what their K/V reads cost (scheduler/step_cost.py).
    num_kv_tokens: int = 0
    top_priority: int | None = None  # the most important priority present
    num_top_tokens: int = 0  # scheduled so far for requests of top_priority
    num_top_kv_tokens: int = 0  # context tokens their rows read
    was_capped: bool = False  # the cap held less important work back
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # req_id -> tokens
    preempted_req_ids: list[str] = field(default_factory=list)
    # Hashes of the full blocks this step's prefills compute: cached from the next step on.
    computing_block_hashes: set[bytes] = field(default_factory=set)
    can_speculate: bool = False  # whether decodes may carry drafts in this step
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # req_id -> its drafts, if any
    row_kv_tokens: dict[str, int] = field(default_factory=dict)  # req_id -> the context its row reads

    def add(self, request: Request, num_tokens: int) -> None:
        """`request`'s row of `num_tokens` tokens from its next position (call before they are
        planned: request.num_planned_tokens is where the row starts)."""
        kv_tokens = request.num_planned_tokens + num_tokens
        self.num_scheduled_tokens[request.req_id] = num_tokens
        self.row_kv_tokens[request.req_id] = kv_tokens
        self.token_budget -= num_tokens
        self.num_tokens += num_tokens
        self.num_kv_tokens += kv_tokens
        if request.priority == self.top_priority:
            self.num_top_tokens += num_tokens
            self.num_top_kv_tokens += kv_tokens

    @property
    def has_seq_room(self) -> bool:
        return len(self.num_scheduled_tokens) < self.max_num_seqs

    def remove(self, request: Request) -> None:
        num_tokens = self.num_scheduled_tokens.pop(request.req_id, 0)
        kv_tokens = self.row_kv_tokens.pop(request.req_id, 0)
        self.draft_token_ids.pop(request.req_id, None)
        self.token_budget += num_tokens
        self.num_tokens -= num_tokens
        self.num_kv_tokens -= kv_tokens
        if request.priority == self.top_priority:
            self.num_top_tokens -= num_tokens
            self.num_top_kv_tokens -= kv_tokens

    @property
    def capped_budget(self) -> int:
        """Tokens left for a less important request's prefill: within the step's cap, if any."""
        if self.step_token_cap is None:
            return self.token_budget
        return max(0, min(self.token_budget, self.step_token_cap - self.num_tokens))

    def capped_tokens(self, start_pos: int = 0, wanted: int | None = None) -> int:
        """Tokens a less important row from position `start_pos` may have (at most `wanted`): within
        the step's cap of tokens and, once it has one, of time (the row's tokens and the context
        they read added to the step's, as the cost model predicts them)."""
        tokens = self.capped_budget if wanted is None else min(wanted, self.capped_budget)
        if self.time_cap is None or tokens <= 0:
            return tokens
        return self.time_cap.chunk_within(self.num_tokens, self.num_kv_tokens, start_pos, tokens)
