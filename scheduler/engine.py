"""The in-process engine: the scheduler core driving a worker group, no Redis, no Ray.

    engine.add_request(...)  ->  engine.step()  ->  scheduler.schedule()
                                               ->  executor.submit(batch)    (all ranks)
                                               ->  executor.collect(...)
                                               ->  scheduler.update_from_output(...)

A pipeline-parallel group takes `executor.pipeline_depth` steps in flight: `step` keeps that
many submitted (each with requests the others do not have) and takes back the oldest, so
every stage has a step to work on while the scheduler handles the tokens of another.

Async scheduling (`EngineConfig.async_scheduling`, one stage): `step` keeps two steps in
flight with the same requests. It schedules and submits step n+1 while the device still runs
step n, each decode's input the token step n samples, which stays on the device; then it
collects step n, which waits for step n only. Stop checks, aborts and preemption therefore act
one step late; the scheduler drops what the step ahead computed for a finished request. A step
ahead with grammar rows samples late (`StepBatch.samples_late`): `step` has it sampled
(`executor.sample`) as soon as step n's constrained rows are taken back and their tokens
accepted by the matchers, before the rest of step n's rows are (scheduler/finishing.py), and
before the next step is submitted.

`generate` runs a list of prompts to completion; the Redis service loop (a later issue)
calls `add_request` / `step` itself.
"""

from __future__ import annotations

import collections
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Protocol

from protocol.usage import Usage
from scheduler.grammar import Grammars
from scheduler.lora_slots import LoraSlots, RegisteredLora
from scheduler.pooling import (
    EmbeddingResult,
    PoolingRequests,
    check_runner,
    embed_all,
    wrong_runner_error,
)
from scheduler.request import FinishReason, Request, TokenLogprobs
from scheduler.scheduler import RequestOutput, Scheduler, SchedulerConfig, SchedulerOutput
from scheduler.speculative.draft_model import build_draft_proposer, check_draft_model
from scheduler.step_trace import open_from_env as open_step_trace
from scheduler.step_trace import write_step as trace_step
from shared import gc_tuning
from shared.config import EngineConfig
from shared.errors import InvalidRequestError, ModelLoadError, WorkerError
from shared.logging import get_logger
from shared.long_context import rope_offset
from shared.lora_config import read_lora_config
from shared.model_config import load_model_config
from shared.pooling_params import POOLING_SAMPLING, PoolingParams
from shared.sampling import SamplingParams
from shared.step import StepResult
from shared.tokenizer import load_tokenizer
from workers.executor import Executor, make_executor


@dataclass
class GenerationResult:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0

    @property
    def usage(self) -> Usage:
        return Usage(len(self.prompt_token_ids), len(self.token_ids), self.num_cached_tokens)

    def to_json_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason.value if self.finish_reason else None,
                "usage": self.usage.to_dict()}


class StepObserver(Protocol):
    """Told what each step did (scheduler/engine_metrics.py is one)."""

    def record_step(self, output: SchedulerOutput, outputs: list[RequestOutput], duration_s: float,
                    result_wait_s: float = 0.0) -> None:
        ...


class LLMEngine:
    def __init__(self, config: EngineConfig, *, tokenizer=None, load_tokenizer_files: bool = True):
        # Read first: a missing or broken folder fails clearly before any process starts.
        self.model_config = load_model_config(config.model)
        if config.pp > self.model_config.num_layers:
            raise ModelLoadError(f"pp={config.pp} pipeline stages need at least as many layers; "
                                 f"{config.model!r} has {self.model_config.num_layers}")
        check_runner(config, self.model_config)
        self.config = config
        self.tokenizer = tokenizer
        # --runner pooling: embeddings (scheduler/pooling.py); None: text generation.
        self.pooling = PoolingRequests(config.model) if config.runner == "pooling" else None
        if self.tokenizer is None and load_tokenizer_files:
            self.tokenizer = load_tokenizer(config.model)
        spec = config.speculative_config
        has_draft = spec is not None and spec.method == "draft_model"
        if has_draft:
            check_draft_model(config, self.model_config)  # before any model is loaded
        self.executor: Executor = make_executor(config)
        proposer = None
        if has_draft:
            try:  # after the target: on CUDA the draft's cache is sized from what the target left
                proposer = build_draft_proposer(config, self.model_config, self.executor.max_model_len)
            except BaseException:
                self.executor.shutdown()
                raise
        # A pipeline's steps in flight hold different requests; they overlap already.
        self.async_scheduling = config.async_scheduling and self.executor.pipeline_depth == 1
        # Steps submitted and not yet collected, at most.
        self.max_in_flight = 2 if self.async_scheduling else self.executor.pipeline_depth
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        # A tokenizer that knows its model's stop set (Qwen's ChatML: <|im_end|>, <|im_start|>).
        self.eos_token_ids.update(getattr(self.tokenizer, "stop_token_ids", ()))
        self.scheduler = Scheduler(
            SchedulerConfig(
                # (pooling: an input may fill the context; its one placeholder token is never computed)
                max_model_len=self.executor.max_model_len + (self.pooling is not None),
                num_kv_blocks=self.executor.num_kv_blocks,
                block_size=self.executor.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
                enable_prefix_caching=config.enable_prefix_caching and self.pooling is None,
                pipeline_depth=self.executor.pipeline_depth,
                async_scheduling=self.async_scheduling,
                samples_late=self.async_scheduling and self.executor.samples_late,
                itl_target_ms=config.itl_target_ms,
                itl_slowdown=config.itl_slowdown,
                max_loras=config.max_loras if config.enable_lora else 0,
                speculative=config.speculative_config,
                num_host_kv_blocks=self.executor.num_host_kv_blocks,
                kv_block_bytes=self.executor.kv_block_bytes,
            ),
            self.tokenizer,
            Grammars(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids),
                     jump_forward=config.grammar_jump_forward),
            proposer,
        )
        self._req_counter = itertools.count()
        self._num_failed_steps = 0  # consecutive, reset by a good step
        # Steps submitted and not yet collected, oldest first: (output, executor handle, scheduled at,
        # submitted at).
        self._in_flight: collections.deque[tuple[SchedulerOutput, object, float, float]] = collections.deque()
        # The engine owns its runtime: from here to close() Python's collector is tuned for
        # serving (shared/gc_tuning.py), for the Python API, `generate` and the service alike.
        gc_tuning.hold()
        self._last_collected_at = 0.0  # when the last step's result came back (perf_counter)
        self.num_group_restarts = 0
        self.num_steps = 0  # steps that ran on the workers
        self.step_observer: StepObserver | None = None
        self.step_trace = open_step_trace()  # a line per step when asked for (scheduler/step_trace.py)
        self.log = get_logger("tokenfleet.engine")
        for name, path in config.lora_modules.items():
            if not config.enable_lora:
                raise ModelLoadError("lora_modules are given but enable_lora is off")
            self.add_lora(name, path)

    @property
    def max_model_len(self) -> int:
        return self.executor.max_model_len

    # -- prompts ------------------------------------------------------------------

    def encode(self, prompt: str, *, chat: bool = False) -> list[int]:
        """Token ids of a text prompt, through the chat template when `chat`."""
        if self.tokenizer is None:
            raise InvalidRequestError("text prompts need a tokenizer in the model folder", param="prompt")
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise InvalidRequestError("this model's tokenizer has no chat template", param="chat")
            messages = [{"role": "user", "content": prompt}]
            if hasattr(self.tokenizer, "chat_ids"):  # built as ids (shared/qwen_tokenizer.py)
                return self.tokenizer.chat_ids(messages)
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return self.tokenizer(text, add_special_tokens=False).input_ids
        return self.tokenizer(prompt).input_ids

    # -- requests -----------------------------------------------------------------

    def add_request(
        self, prompt_token_ids: list[int], sampling: SamplingParams, *, priority: int = 0,
        req_id: str | None = None, arrival_time: float | None = None,
        output_token_ids: list[int] | None = None, output_text: str = "", tenant: str | None = None,
        lora_name: str | None = None, pooling: PoolingParams | None = None,
    ) -> str:
        """Queue a request. `output_token_ids`/`output_text` resume one that another
        scheduler started: generation continues after those tokens, which are not sent again.
        `pooling`: an embedding request (the engine must run with --runner pooling)."""
        req_id = req_id or f"req-{next(self._req_counter)}"
        if (pooling is not None) != (self.pooling is not None):
            raise wrong_runner_error(self.config.runner, wants_pooling=pooling is not None)
        if pooling is not None:
            sampling, output_token_ids, output_text = POOLING_SAMPLING, None, ""  # nothing to resume
            if len(prompt_token_ids) > self.max_model_len:
                raise InvalidRequestError(
                    f"the input has {len(prompt_token_ids)} tokens, more than the model's maximum context "
                    f"length of {self.max_model_len} tokens", param="input")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})", param="prompt"
            )
        cfg = self.model_config
        request = Request(req_id, list(prompt_token_ids), sampling, priority=priority,
                          eos_token_ids=set(self.eos_token_ids), tenant=tenant,
                          output_token_ids=list(output_token_ids or []),
                          rope_offset=rope_offset(len(prompt_token_ids), seq_length=cfg.seq_length,
                                                  use_dynamic_ntk=cfg.use_dynamic_ntk,
                                                  stride=self.executor.max_model_len))
        if lora_name is not None:
            request.lora = self._lora_slots().get(lora_name)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        request.output_text = output_text
        if pooling is not None:
            self.pooling.add(req_id, pooling)
        try:
            self.scheduler.add_request(request)
        except InvalidRequestError:
            if pooling is not None:
                self.pooling.forget(req_id)
            raise
        if lora_name is not None:  # (counted once accepted: a refused request is not one)
            self.scheduler.lora_slots.num_requests[lora_name] += 1
        return req_id

    # -- LoRA adapters (scheduler/lora_slots.py) -------------------------------------

    def _lora_slots(self) -> LoraSlots:
        if self.scheduler.lora_slots is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (enable_lora is off)",
                                      param="model")
        return self.scheduler.lora_slots

    def add_lora(self, name: str, path: str) -> RegisteredLora:
        """Serve the PEFT adapter at `path` as `name`; LoraAdapterError (a 400) when it cannot run on
        this base. Its tensors are read by the runners when a step first needs it."""
        slots = self._lora_slots()
        if not name or name in slots.adapters:
            raise InvalidRequestError(f"a LoRA adapter named {name!r} is loaded already" if name
                                      else "the adapter needs a name", param="lora_name")
        lora = read_lora_config(path, self.model_config, base_path=self.config.model,
                                max_lora_rank=self.config.max_lora_rank)
        adapter = slots.register(name, path, lora.rank)
        self.log.info("lora_added", lora_name=name, path=path, rank=lora.rank)
        return adapter

    def remove_lora(self, name: str) -> None:
        """Serve `name` no more; its running requests finish on it."""
        self._lora_slots().unregister(name)
        self.log.info("lora_removed", lora_name=name)

    def lora_names(self) -> list[str]:
        slots = self.scheduler.lora_slots
        return sorted(slots.adapters) if slots is not None else []

    def abort(self, req_id: str) -> None:
        self.scheduler.abort_request(req_id)

    def has_unfinished_requests(self) -> bool:
        """True while requests wait or run, or a step is still in flight (collected before the
        engine counts as idle, so that the group's ranks can park)."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def step(self) -> list[RequestOutput]:
        """Submit steps until max_in_flight are (or nothing more can run), then take back the
        oldest; returns what it (and any step with nothing to run) produced."""
        outputs: list[RequestOutput] = []
        try:
            while len(self._in_flight) < self.max_in_flight:
                if (self.async_scheduling and self._in_flight
                        and self.scheduler.has_requests_needing_their_token()):
                    break  # no step ahead while one would leave such a request out of it
                started = time.perf_counter()
                output = self.scheduler.schedule()
                if not output.batch.works and not output.batch.has_kv_copies:  # only aborts (or preemption)
                    done = self.scheduler.update_from_output(output, StepResult(output.batch.step_id, []))
                    if self.pooling is not None:
                        self.pooling.finish_outputs(done, {})
                    if done or output.preempted_req_ids:
                        self._observe(output, done, started)
                    outputs += done
                    break
                submitted = time.perf_counter()
                self._in_flight.append((output, self.executor.submit(output.batch), started, submitted))
            if not self._in_flight:
                return outputs
            output, handle, started, submitted = self._in_flight.popleft()
            waiting = time.perf_counter()
            result = self.executor.collect(handle)
            collected = time.perf_counter()
            result_wait_s = collected - waiting
        except WorkerError as exc:
            self._recover(exc)
            return outputs
        # What the step cost its tokens: from the previous result (the device went on from there)
        # or from its submission (when the device had nothing before it) to its own result.
        step_ms = (collected - max(self._last_collected_at, submitted)) * 1000
        self._last_collected_at = collected
        if output.batch.works:  # (a step of host-tier copies alone says nothing of step costs)
            self.scheduler.observe_step(output, step_ms)
        if self.step_trace is not None:
            trace_step(self.step_trace, output, step_ms, self.scheduler)
        self._num_failed_steps = 0
        self.num_steps += 1
        failed: list[WorkerError] = []
        sample_late = None
        if self._in_flight and self._in_flight[0][0].batch.samples_late:
            late_output, late_handle, _, late_submitted = self._in_flight[0]

            def sample_late() -> None:
                # Its grammar rows' inputs were this step's tokens, which the matchers have now
                # accepted: fill its mask and sample it (its forward may still run on the device),
                # before the other rows of this step are taken (scheduler/finishing.py).
                late_output.batch.late_sample_wait_s = time.perf_counter() - late_submitted
                try:
                    self.executor.sample(late_handle)
                except WorkerError as exc:
                    failed.append(exc)  # (recovered once this step is taken back whole)

        done = self.scheduler.update_from_output(output, result, on_grammars_accepted=sample_late)
        if self.pooling is not None:
            self.pooling.finish_outputs(done, result.pooled)
        if failed:
            self._recover(failed[0])
            return outputs + done
        self._observe(output, done, started, result_wait_s)
        return outputs + done

    @property
    def num_in_flight(self) -> int:
        """Steps submitted and not yet collected."""
        return len(self._in_flight)

    def _observe(self, output: SchedulerOutput, outputs: list[RequestOutput], started: float,
                 result_wait_s: float = 0.0) -> None:
        """result_wait_s: how long this thread was blocked on the step's result (collect)."""
        if self.step_observer is not None:
            self.step_observer.record_step(output, outputs, time.perf_counter() - started, result_wait_s)

    def _recover(self, exc: WorkerError) -> None:
        """A rank died mid-step: its KV cache is gone. Rebuild the group, and let every
        running request recompute from the tokens it already has (nothing is re-sent)."""
        self._num_failed_steps += 1
        self._in_flight.clear()  # their steps died with the group
        if self._num_failed_steps > self.config.max_group_restarts:
            raise exc
        preempted = self.scheduler.preempt_all_running()
        self.log.warning("worker_group_failed", error=exc.message, num_requeued=len(preempted),
                         attempt=self._num_failed_steps)
        self.executor.restart()
        self.num_group_restarts += 1

    def generate(
        self, prompts: list[str | list[int]], sampling: SamplingParams | list[SamplingParams],
        *, chat: bool = False, lora_names: list[str | None] | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt to completion, all batched together; results in prompt order.
        `lora_names`: each prompt's adapter (None: the base)."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        loras = lora_names if lora_names is not None else [None] * len(prompts)
        results: dict[str, GenerationResult] = {}
        order: list[str] = []
        for prompt, sp, lora_name in zip(prompts, params, loras, strict=True):
            ids = prompt if isinstance(prompt, list) else self.encode(prompt, chat=chat)
            req_id = self.add_request(ids, sp, lora_name=lora_name)
            results[req_id] = GenerationResult(req_id, list(ids),
                                               logprobs=[] if sp.logprobs is not None else None)
            order.append(req_id)
        while self.has_unfinished_requests():
            for out in self.step():
                collect_output(results[out.req_id], out)
        return [results[req_id] for req_id in order]

    def embed(self, prompts: list[str | list[int]], *, dimensions: int | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingResult]:
        """The embedding of every prompt (text or token ids), all batched together, in prompt
        order (--runner pooling). `truncate_prompt_tokens`: keep only each prompt's last that many
        tokens (vLLM's extension), else a prompt past the model's length is refused."""
        if self.pooling is None:
            raise wrong_runner_error(self.config.runner, wants_pooling=True)
        return embed_all(self, prompts, PoolingParams(dimensions=dimensions), truncate_prompt_tokens)

    def warm_up(self) -> None:
        """Run a few throwaway requests through every kind of step (long prefill chunks, mixed
        prefill and decode, decode): the GPU kernels compile for their shapes now, not in the
        middle of serving the first users' requests."""
        limit = min(self.max_model_len, self.config.max_num_batched_tokens) - 8
        lengths = sorted({max(1, min(n, limit)) for n in (16, 200, 1000, 3000, 6000)})
        rng = random.Random(0)
        vocab = self.model_config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
        if self.pooling is not None:  # prefill steps only; no step cost to calibrate from decodes
            self.embed(prompts * 4)
            return
        self.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        self.calibrate_step_cost(rng)
        self.prepare_grammars()
        gc_tuning.refreeze()  # the kernels and graphs the warm-up built live as long as the engine

    def prepare_grammars(self) -> None:
        """Structured outputs' tables and compiler built now (scheduler/grammar.py), so that the
        first constrained request costs what the hundredth does. The service calls it at its start."""
        if self.scheduler.grammars is not None:
            self.scheduler.grammars.prepare()

    def calibrate_step_cost(self, rng: random.Random | None = None) -> None:
        """Time steps of 16, 32, ... up to max_num_batched_tokens tokens (one prompt each, with its
        first decode) for the step cost model (scheduler/step_cost.py), after the warm-up's first
        steps, whose times are compilation's. Serving then refines the model with every step."""
        rng = rng or random.Random(0)
        vocab = self.model_config.vocab_size
        self.scheduler.latency_budget.reset()
        limit = min(self.max_model_len - 8, self.config.max_num_batched_tokens)
        num_tokens = 16
        while num_tokens <= limit:
            prompt = [rng.randrange(vocab) for _ in range(num_tokens)]  # (no prefix in the cache)
            self.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
            num_tokens *= 2
        self.log.info("step_cost_calibrated", points=[
            (round(point.num_tokens), round(point.ms, 2)) for point in self.scheduler.step_cost.points()])

    def close(self) -> None:
        """Stop the worker group and give its device memory back (graphs, KV cache, weights),
        so that another engine built in this process finds it free. Idempotent; requests still
        queued or running are dropped with it."""
        if getattr(self, "_is_closed", False):
            return
        self._is_closed = True
        gc_tuning.release()
        self.executor.shutdown()
        if self.scheduler.speculator is not None:
            self.scheduler.speculator.close()  # a draft model's weights and KV cache

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def collect_output(result: GenerationResult, out: RequestOutput) -> None:
    result.token_ids.extend(out.new_token_ids)
    result.text += out.text_delta
    if out.logprobs is not None and result.logprobs is not None:
        result.logprobs.extend(out.logprobs)
    if out.finished:
        result.finish_reason = out.finish_reason
        result.stop_reason = out.stop_reason
        result.num_cached_tokens = out.num_cached_tokens
