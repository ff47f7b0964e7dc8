"""What the scheduler sends the workers each step, and what comes back.

These cross a process boundary to the ranks (Ray's compiled-graph channels) every step, so
they are plain dataclasses of lists and numbers. Pickled, a batch and a result turn into nested
tuples and lists first (`__reduce__`): Ray pickles with cloudpickle, whose Python-level hook
runs for every object except plain lists, tuples, strings and numbers, and a batch of 256
works was otherwise about a fifth of a pipelined scheduler's time (py-spy, two H200s).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.sampling import SamplingParams


@dataclass
class SequenceWork:
    """One sequence's share of a step: a prefill chunk, or one decode token."""

    req_id: str
    # Tokens whose K/V this step computes; they sit at positions
    # [start_pos, start_pos + len(token_ids)) of the sequence.
    token_ids: list[int]
    start_pos: int  # == the request's num_computed_tokens before this step
    block_ids: list[int]  # block table covering at least start_pos + len(token_ids) slots
    # True when the chunk reaches the last known token: the runner samples a next token.
    is_sampled: bool
    sampling: SamplingParams
    # How many tokens the request has generated so far; with a seed this picks the
    # random stream, so a request resumed after preemption samples the same tokens.
    num_output_tokens: int = 0
    # Only filled when sampling.has_penalties and is_sampled (penalties need history).
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # Async scheduling: token_ids is [one decode token] that the previous step samples and the
    # scheduler does not know yet (its value here means nothing); the runner takes it from that
    # step's sampled ids on the device.
    is_token_pending: bool = False
    # Added to the positions the model's rotary embedding reads (not to the KV slots): a model
    # with one rotary table per sequence class (Qwen's dynamic NTK, shared/long_context.py)
    # stacks them, and a sequence reads its own. 0 for every other model.
    rope_offset: int = 0
    # Prompt logprobs (sampling.prompt_logprobs set): the prompt tokens that this chunk's first
    # rows predict, row i predicting prompt token start_pos + 1 + i (workers/prompt_logprobs.py).
    # Empty for every other work.
    prompt_logprob_ids: list[int] = field(default_factory=list)
    # The LoRA slot whose adapter this sequence runs with (StepBatch.lora_loads fills it); 0: the
    # base model alone.
    lora_slot: int = 0
    # Speculative decoding: the last num_draft_tokens of token_ids are proposed tokens, not known
    # ones. The runner scores every one of them in this forward and returns how many it accepted
    # (SampledToken.num_accepted_drafts; workers/spec_verify.py). 0 for every other work.
    num_draft_tokens: int = 0


@dataclass(frozen=True)
class LoraLoad:
    """Put an adapter in a runner's slot before the step runs (workers/lora/manager.py)."""

    slot: int  # 1..max_loras
    adapter_id: int  # the engine's id of this registration: a name loaded again gets a new one
    name: str
    path: str  # its PEFT folder


@dataclass
class TokenBitmask:
    """Which tokens the grammar-constrained rows of a step may sample (scheduler/grammar.py)."""

    # Row i of `bits` applies to logits row rows[i]: the index among the step's sampled works.
    rows: list[int]
    # int32 CPU tensor [len(rows), ceil(vocab / 32)]: bit t set = token t allowed. Typed as
    # object so that this contract does not import torch.
    bits: object


@dataclass
class StepBatch:
    step_id: int
    works: list[SequenceWork]
    token_mask: TokenBitmask | None = None  # None: no row is constrained (the common case)
    # The seam between the grammars and the runner: when set, what fills token_mask, called
    # (through resolve_token_mask, once) by the sampling runner after it has launched the step's
    # forward and before it samples, so the host fills the bitmask while the device computes.
    # In process only: a batch is pickled with token_mask resolved (RayWorkerGroup.submit).
    mask_filler: Callable[[], TokenBitmask | None] | None = field(default=None, repr=False, compare=False)
    # Requests that left the batch for good since the last batch (finished, aborted, preempted):
    # the runners give back their block-table rows (workers/device_block_tables.py).
    freed_req_ids: list[str] = field(default_factory=list)
    # Async scheduling with grammars: a constrained row's input is the previous step's token, which
    # its matcher has not accepted yet, so the step's mask cannot be filled at launch. The runner
    # launches the forward only; the step is sampled (mask filled, uploaded, every row sampled)
    # by `Executor.sample`, which the engine calls once the previous step's tokens are accepted.
    # In process only, like mask_filler.
    samples_late: bool = field(default=False, compare=False)
    # What the grammar work cost the host, for the step trace (scheduler/step_trace.py), in
    # process only: the seconds the mask's fill took (resolve_token_mask), and for a step that
    # samples late the seconds from its submission to its sampling (the engine sets it).
    mask_fill_s: float = field(default=0.0, compare=False)
    late_sample_wait_s: float = field(default=0.0, compare=False)
    # Adapters the runners load into slots before this step (LoRA engines only).
    lora_loads: list[LoraLoad] = field(default_factory=list)
    # The host KV tier's copies (scheduler/host_tier.py, workers/host_kv_pool.py), each rank on
    # its own shard, on a stream of their own: (GPU block, host slot) pairs to store, (host slot,
    # GPU block) pairs to load. Complete on every rank when the step's result comes back.
    kv_stores: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(w.token_ids) for w in self.works)

    @property
    def has_kv_copies(self) -> bool:
        """Whether the step carries host-tier copies (it runs even with no works)."""
        return bool(self.kv_stores or self.kv_loads)

    def resolve_token_mask(self) -> TokenBitmask | None:
        """The step's token mask: mask_filler's, called now (the first time), else token_mask."""
        if self.mask_filler is not None:
            filler, self.mask_filler = self.mask_filler, None
            started = time.perf_counter()
            self.token_mask = filler()
            self.mask_fill_s = time.perf_counter() - started
        return self.token_mask

    def __reduce__(self):
        if self.mask_filler is not None:
            # The filler holds the scheduler's matchers, which stay in this process.
            raise ValueError(f"step {self.step_id}: resolve_token_mask() before the batch leaves the process")
        if self.samples_late:
            raise ValueError(f"step {self.step_id} samples late, which only an in-process runner does")
        # A dataclass instance's __dict__ holds its fields in declaration order (its __init__
        # sets them so): SamplingParams(*values) rebuilds it, and fails loudly if that changes.
        works = [(w.req_id, w.token_ids, w.start_pos, w.block_ids, w.is_sampled,
                  tuple(vars(w.sampling).values()), w.num_output_tokens,
                  w.prompt_token_ids, w.output_token_ids, w.is_token_pending, w.rope_offset,
                  w.prompt_logprob_ids, w.lora_slot, w.num_draft_tokens)
                 for w in self.works]
        loads = [tuple(vars(load).values()) for load in self.lora_loads]
        return _batch_from_wire, (self.step_id, works, self.token_mask, self.freed_req_ids, loads,
                                  self.kv_stores, self.kv_loads)


@dataclass
class SampledToken:
    req_id: str
    token_id: int
    logprob: float | None = None  # of the chosen token, when sampling.logprobs is not None
    # (token_id, logprob) of the top N, best first, when sampling.logprobs > 0
    top_logprobs: list[tuple[int, float]] | None = None
    # Work with drafts: how many of them were accepted; they come before token_id, which is the
    # target's own token after them (at the first rejected position, or after the last draft).
    num_accepted_drafts: int = 0


@dataclass
class StepResult:
    step_id: int
    sampled: list[SampledToken]  # one per work with is_sampled, in the batch's order
    # req_id -> one entry per SequenceWork.prompt_logprob_ids of its work, in order:
    # [token_id, logprob, [[id, logprob], ...] | None] (the top N when sampling.prompt_logprobs > 0)
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    # Seconds the driver rank's host-tier loads took that completed since its previous result
    # (0.0: none; a load is timed once done, never waited for), for the load rate.
    kv_load_seconds: float = 0.0
    # A pooling runner's step (workers/pooling_runner.py): req_id -> the embedding of each input
    # whose last chunk ran, float32 bytes (its token in `sampled` is a placeholder).
    pooled: dict[str, bytes] = field(default_factory=dict)

    def __reduce__(self):
        sampled = [(s.req_id, s.token_id, s.logprob, s.top_logprobs, s.num_accepted_drafts)
                   for s in self.sampled]
        return _result_from_wire, (self.step_id, sampled, self.prompt_logprobs, self.kv_load_seconds,
                                   self.pooled)


def _batch_from_wire(step_id: int, works: list[tuple], token_mask: TokenBitmask | None,
                     freed_req_ids: list[str], lora_loads: list[tuple] = (), kv_stores: list = (),
                     kv_loads: list = ()) -> StepBatch:
    return StepBatch(step_id, [
        SequenceWork(req_id, token_ids, start_pos, block_ids, is_sampled, SamplingParams(*sampling),
                     num_output_tokens, prompt_token_ids, output_token_ids, is_token_pending, rope_offset,
                     prompt_logprob_ids, lora_slot, num_draft_tokens)
        for (req_id, token_ids, start_pos, block_ids, is_sampled, sampling, num_output_tokens,
             prompt_token_ids, output_token_ids, is_token_pending, rope_offset, prompt_logprob_ids,
             lora_slot, num_draft_tokens) in works
    ], token_mask, freed_req_ids=freed_req_ids, lora_loads=[LoraLoad(*load) for load in lora_loads],
        kv_stores=list(kv_stores), kv_loads=list(kv_loads))


def _result_from_wire(step_id: int, sampled: list[tuple], prompt_logprobs: dict[str, list],
                      kv_load_seconds: float = 0.0, pooled: dict[str, bytes] | None = None) -> StepResult:
    sampled_tokens = [SampledToken(*fields) for fields in sampled]
    return StepResult(step_id, sampled_tokens, prompt_logprobs, kv_load_seconds, pooled or {})
