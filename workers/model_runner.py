"""One rank's model: builds it, loads its weight shards, owns its KV cache, runs steps.

Every rank runs `execute` on the same StepBatch; only the driver rank (rank 0 of the last
pipeline stage) samples and returns a StepResult (the others return None). Under pipeline
parallelism a rank holds its stage's layers and their KV cache only; a stage after the first
receives its input activation from the previous stage, one before the last sends its output on.
On CUDA, decode-only steps replay a graph of their batch size (`workers/cuda_graphs.py`) and
mixed steps one of their token count (`workers/mixed_graphs.py`); larger steps run eagerly.

A step is `launch`ed (inputs, forward, mask, sampling: nothing waits for the device) and then
`finish`ed (the sampled ids read on the host). A step that samples late (`StepBatch.samples_late`:
a constrained row's mask needs the previous step's token accepted first) launches its forward
only; `sample` then fills and uploads the mask and samples every row, the logits having stayed
on the device. Under async scheduling the in-process executor
launches step n+1 before it finishes step n: the runner keeps each step's sampled ids on the
device for the next step's pending inputs (`workers/pending_tokens.py`). Every path's inputs go up
through one pinned staging ring (`workers/host_staging.py`), and read their block tables from one
persistent device table that each step updates by diffs (`workers/device_block_tables.py`).
How the runner is built (model, KV cache, graphs) is `workers/runner_build.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.config import EngineConfig
from shared.errors import ModelLoadError
from shared.logging import get_logger
from shared.model_config import ModelConfig, load_model_config
from shared.step import SequenceWork, StepBatch, StepResult
from workers import prompt_logprobs, spec_verify
from workers.device import place_rank
from workers.device_sample import HostSample
from workers.grammar_mask import apply_token_mask
from workers.host_kv_pool import KVCopies
from workers.host_staging import HostStaging
from workers.layers import fp8_tuning, kv_scales
from workers.layers.kv_fp8 import kv_cache_dtype
from workers.parallel import TensorParallel
from workers.pending_tokens import PendingTokens, share
from workers.pipeline import SINGLE_STAGE, PipelineStage
from workers.prompt_logprobs import DevicePromptLogprobs
from workers.runner_build import (  # noqa: F401 - format_bytes, kv_blocks_for_budget: imported from here too
    RunnerBuild,
    format_bytes,
    free_cache_and_weights,
    kv_blocks_for_budget,
    release_device_memory,
    resolve_quantization,
)
from workers.sampler import Sampler
from workers.step_inputs import build_step_inputs
from workers.weight_loader import resident_weight_bytes


@dataclass
class LaunchedStep:
    """A step queued on the device; `ModelRunner.finish` reads its result."""

    step_id: int
    host: HostSample | None  # the sampled ids on their way to the host (driver); None: no row sampled
    # A step that samples late, until `ModelRunner.sample`: its batch, logits and sampled works.
    late: tuple[StepBatch, torch.Tensor, list[SequenceWork]] | None = None
    prompt_logprobs: DevicePromptLogprobs | None = None  # the driver's, when a work asked for them
    # Speculative decoding (workers/spec_verify.py): the logits scoring the step's drafts, until
    # sampled, then their verification (the driver's).
    draft_logits: torch.Tensor | None = None
    verify: spec_verify.DeviceVerify | None = None
    kv_copies: KVCopies | None = None  # the host tier's copies it carries (workers/host_kv_pool.py)

class ModelRunner(RunnerBuild):
    def __init__(self, config: EngineConfig, tp: TensorParallel, stage: PipelineStage = SINGLE_STAGE) -> None:
        self.config = config
        self.tp = tp
        self.stage = stage
        self.world_size = tp.size * stage.size
        self.rank = stage.index * tp.size + tp.rank  # in the whole group
        self.is_driver = tp.is_driver and stage.is_last  # samples, and answers the scheduler
        self.log = get_logger("tokenfleet.worker", rank=self.rank)
        self.device, self.dtype = place_rank(config.device, config.dtype, self.rank, config.num_threads)
        self.model_config: ModelConfig = load_model_config(config.model)
        self.max_model_len = min(config.max_model_len or self.model_config.context_window,
                                 self.model_config.context_window)
        self.block_size = config.block_size
        self.quantization = resolve_quantization(config.quantization, self.model_config, self.device)
        try:
            self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
        self._check_weight_budget()
        self.model = self._build_model()
        self.weight_bytes = resident_weight_bytes(self.model)
        self.staging = HostStaging(self.device)  # every host-to-device upload of step inputs
        self.lora = self._wrap_lora()  # None unless the engine serves adapters
        self.num_kv_blocks = self._decide_num_kv_blocks()  # what the scheduler may hand out
        self.kv_caches = self._allocate_kv_cache()  # holds one more: the scratch block
        self.host_kv = self._allocate_host_kv()  # the host KV tier's pool; None: no tier
        self._timed_loads: list[KVCopies] = []  # copies with loads whose time is not reported yet
        self.block_tables = self._new_block_tables()
        # FP8 products are chosen by timing them: now, not in the first served step when graphs
        # are off (with graphs the capture's warm-up would do it). Nothing without FP8 layers.
        fp8_tuning.tune(self.model, self.device, self.dtype)
        self.decode_graphs = self._capture_decode_graphs()
        self.mixed_graphs = self._capture_mixed_graphs()
        # An FP8 cache's scales: the checkpoint's, or measured by the first real step, which runs
        # eagerly (after the capture, whose warm-ups run on dummy inputs; kv_scales.py).
        self.kv_scale_measurement = kv_scales.prepare(self.model, self.kv_dtype, config.calculate_kv_scales,
                                                      self.log)
        self.sampler = Sampler(seed=config.seed) if self.is_driver else None
        # Async scheduling (one pipeline stage): each step's sampled ids stay on the device for
        # the next step's pending inputs, on every rank of the stage.
        keeps_ids = config.async_scheduling and stage.size == 1
        self.pending_tokens = PendingTokens(self.device, self.staging) if keeps_ids else None
        self.is_closed = False

    @torch.inference_mode()
    def forward(self, batch: StepBatch,
                use_graphs: bool = True) -> tuple[torch.Tensor | None, list[SequenceWork]]:
        """The step's forward pass: the logits of the rows to sample ([num_sampled, vocab], in
        the model's dtype; None when no row samples) and the works they belong to. A captured
        CUDA graph runs it when one fits and `use_graphs`; otherwise it runs eagerly. A stage
        before the last sends its activation on and returns (None, [])."""
        logits, works, _, _ = self._forward(batch, use_graphs)
        return logits, works

    def _forward(self, batch: StepBatch, use_graphs: bool = True) -> tuple[
            torch.Tensor | None, list[SequenceWork], DevicePromptLogprobs | None, torch.Tensor | None]:
        """forward(), the step's prompt logprobs (the driver's; None when no work asks), and the
        logits that score its drafts (None when no work has drafts)."""
        if self.is_closed:
            raise RuntimeError("this model runner is closed; it runs no more steps")
        hidden_in = None
        if not self.stage.is_first:
            hidden_in = self.stage.receive(batch.num_tokens, self.model_config.hidden_size, self.dtype,
                                           self.device)
        fill_tokens = None
        if self.pending_tokens is not None:
            def fill_tokens(token_ids: torch.Tensor) -> None:
                self.pending_tokens.fill(token_ids, batch.works)
        elif any(w.is_token_pending for w in batch.works):
            raise RuntimeError("a pending input token, but this runner does not keep sampled ids "
                               "(async_scheduling is off, or pipeline stages)")
        # Prompt logprobs and drafts need rows besides the last of a work. The eager step keeps
        # every row (in eager_order), and so do the mixed graphs (decodes first, then the other
        # works in batch order: the same rows), so a verify step replays one; the decode graphs
        # keep one row per work. Prompt logprobs run eagerly.
        has_drafts = spec_verify.wanted(batch.works)
        use_graphs = (use_graphs and not prompt_logprobs.wanted(batch.works)
                      and not self.kv_scale_measurement.is_pending)
        if self.lora is not None:
            self.lora.apply_loads(batch.lora_loads)
        if (use_graphs and not has_drafts and self.decode_graphs is not None
                and self.decode_graphs.can_run(batch.works)):
            if self.lora is not None:  # (dense: the graphs read each row's slot from its buffer)
                self.lora.prepare_rows(batch.works, self.decode_graphs.padded_size(len(batch.works)))
            out = self.decode_graphs.run(batch.works, hidden_in, fill_tokens, batch.freed_req_ids)
            if not self.stage.is_last:
                self.stage.send(out)
                return None, [], None, None
            return out, batch.works, None, None  # every decode row samples
        if use_graphs and self.mixed_graphs is not None and self.mixed_graphs.can_run(batch.works):
            if self.lora is not None:  # (dense on CUDA: the graph's token rows are the eager step's)
                self.lora.prepare(batch.works, self.device)
            hidden, sample_rows = self.mixed_graphs.run(batch.works, hidden_in, fill_tokens,
                                                        batch.freed_req_ids)
            if not self.stage.is_last:
                self.stage.send(hidden)
                return None, [], None, None
            drafts = None
            if has_drafts:
                drafts = spec_verify.draft_logits(self.model.compute_logits, hidden, batch.works,
                                                     self.staging.upload)
            sampled_works = [w for w in batch.works if w.is_sampled]
            if not sampled_works:
                return None, [], None, drafts
            return self.model.compute_logits(hidden[sample_rows]), sampled_works, None, drafts
        inputs = build_step_inputs(batch, self.block_size, self.device, self.block_tables, self.staging)
        if self.lora is not None:
            self.lora.prepare(batch.works, self.device)
        if fill_tokens is not None:
            fill_tokens(inputs.token_ids)
        hidden = self.model(inputs.token_ids, inputs.positions, self.kv_caches, inputs.meta, hidden_in)
        if not self.stage.is_last:
            self.stage.send(hidden)
            return None, [], None, None
        prompt = None
        if prompt_logprobs.wanted(batch.works):
            prompt = prompt_logprobs.compute(self.model.compute_logits, hidden, batch.works, self.is_driver)
        drafts = None
        if has_drafts:
            drafts = spec_verify.draft_logits(self.model.compute_logits, hidden, batch.works,
                                                     self.staging.upload)
        if not inputs.sampled_works:
            return None, [], prompt, None
        return self.model.compute_logits(hidden[inputs.sample_rows]), inputs.sampled_works, prompt, drafts

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepResult | None:
        """Run a step to its end (launch, then finish)."""
        return self.finish(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> LaunchedStep:
        """Queue the step's work on the device, sampling and the ids' copy to the host included;
        waits for nothing on CUDA."""
        timer = self.tp.timer
        start = timer.start(self.device) if timer else None
        has_copies = self.host_kv is not None and batch.has_kv_copies
        if not batch.works:  # a step of copies alone
            copies = self.host_kv.copy(batch.kv_stores, batch.kv_loads) if has_copies else None
            return LaunchedStep(batch.step_id, None, kv_copies=copies)
        # The copies wait for the earlier steps only, never this one (which neither writes a block
        # a store reads nor reads one a load writes): marked before its forward, queued after it, so
        # that the host queues them while the device computes rather than before it starts.
        earlier = self.host_kv.mark() if has_copies else None
        logits, sampled_works, prompt, drafts = self._forward(batch)
        if timer:
            timer.stop("step", start)
        launched = LaunchedStep(batch.step_id, None, prompt_logprobs=prompt, draft_logits=drafts)
        if batch.samples_late and logits is not None and self.is_driver:
            launched.late = (batch, logits, sampled_works)  # until `sample`
        else:
            self._sample(launched, batch, logits, sampled_works)
        if has_copies:
            launched.kv_copies = self.host_kv.copy(batch.kv_stores, batch.kv_loads, after=earlier)
        return launched

    @torch.inference_mode()
    def sample(self, launched: LaunchedStep) -> None:
        """Sample a step launched with `samples_late` (its mask filled now); before the next
        step is launched, whose pending inputs are this step's samples. Nothing waits for the
        device. A step sampled already: nothing to do."""
        if launched.late is not None:
            (batch, logits, sampled_works), launched.late = launched.late, None
            self._sample(launched, batch, logits, sampled_works)

    def _sample(self, launched: LaunchedStep, batch: StepBatch, logits: torch.Tensor | None,
                sampled_works: list[SequenceWork]) -> None:
        token_ids = None
        if logits is not None and self.is_driver:
            # The forward is launched (on CUDA it runs now): fill the grammar mask on the host
            # meanwhile (StepBatch.mask_filler), then mask the logits behind the forward.
            token_mask = batch.resolve_token_mask()
            if token_mask is not None:
                apply_token_mask(logits, token_mask)
            pending_ids = None
            if self.pending_tokens is not None:  # penalties count the rows' pending tokens too
                pending_ids = self.pending_tokens.penalized_ids(sampled_works)
            # float32 inside, where it matters
            sample = self.sampler.sample_on_device(logits, sampled_works, pending_ids)
            token_ids, launched.host = sample.token_ids, sample.to_host()
            if launched.draft_logits is not None:
                # The works with drafts never have a step ahead (scheduler.py): the ids kept below
                # for pending inputs are never read for them.
                launched.verify = spec_verify.verify(launched.draft_logits, batch.works, self.sampler,
                                                     self.staging.upload)
                launched.draft_logits = None
        if self.pending_tokens is not None and self.stage.is_last:
            if logits is not None:
                token_ids = share(self.tp, token_ids, len(sampled_works), self.device)
            self.pending_tokens.keep(sampled_works, token_ids)

    def finish(self, launched: LaunchedStep) -> StepResult | None:
        """The step's StepResult (driver) or None (other ranks). The step's one host
        synchronisation: waiting for the sampled ids' copy. The host tier's copies it carries are
        not waited for: from here on, every kernel on the compute stream runs after them (on the
        device), so the scheduler, once it has the step back, may hand their GPU blocks out again
        (workers/host_kv_pool.py)."""
        self.sample(launched)  # a late step not sampled yet (run to its end by `execute`)
        copies = launched.kv_copies
        if copies is not None:
            copies.fence()
            if copies.num_loads and self.is_driver:  # (the driver's loads alone are timed)
                self._timed_loads.append(copies)
        if not self.is_driver:
            return None
        prompt = launched.prompt_logprobs.to_host() if launched.prompt_logprobs is not None else {}
        load_seconds = self._done_load_seconds()
        if launched.host is None:
            return StepResult(launched.step_id, [], prompt, load_seconds)
        tokens = launched.host.tokens()
        if launched.verify is not None:
            spec_verify.apply(tokens, launched.verify)
        return StepResult(launched.step_id, tokens, prompt, load_seconds)

    def _done_load_seconds(self) -> float:
        """The time of the host tier's loads complete since the last answer (for the load rate;
        read once done, never waited for)."""
        if not self._timed_loads:
            return 0.0
        done = [copies for copies in self._timed_loads if copies.is_done()]
        self._timed_loads = [copies for copies in self._timed_loads if copies not in done]
        return sum(copies.load_seconds() for copies in done)

    def close(self) -> None:
        """Give back everything this runner took on its device: the CUDA graphs and their memory
        pool, the KV cache, the weights, the sampler's generators; then the caching allocator's
        free blocks. Idempotent; the runner runs no step afterwards. The executors' and
        RankWorker's shutdown call it.

        The KV cache's and the weights' storage is released in place (the cache resized to
        nothing, the parameters and buffers turned into meta tensors), so the memory comes back
        even where something outside the runner still holds the tensor or the module."""
        if self.is_closed:
            return
        self.is_closed = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no kernel in flight may still use what is freed
        for graphs in (self.decode_graphs, self.mixed_graphs):
            if graphs is not None:
                graphs.close()  # before the KV cache and weights its graphs point into
        self.decode_graphs = self.mixed_graphs = None
        self.sampler = None
        self.block_tables = self.staging = self.pending_tokens = None
        if self.host_kv is not None:
            self.host_kv.close()  # (it holds a view of the KV cache)
        self.host_kv = None
        free_cache_and_weights(self)
