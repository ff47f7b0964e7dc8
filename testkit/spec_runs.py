"""What scripts/bench_spec.py times: speculative decoding (n-gram or a draft model) against plain
decoding on the same engine settings, per workload, with the outputs checked token for token.

Workloads (chat prompts through the model's chat template, greedy):
- copy: requests that quote their input back (two passages), one at a time (batch 1);
- chat: open-ended questions whose answers do not repeat the prompt, one at a time;
- batch: `num_batch` requests at once, copy and chat prompts alternating.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from scheduler.engine import LLMEngine
from shared.sampling import SamplingParams
from shared.speculative import SpeculativeConfig, parse_speculative_config

PASSAGES = [
    "The harbour town woke slowly. Fishing boats rocked against the stone quay while gulls argued "
    "over the night's scraps, and the baker on Mill Street pulled the first trays of bread from "
    "his oven. By seven the market square filled with carts of apples, cheese and wool, and the "
    "church bell rang twice to call the ferry passengers to the pier. Nobody noticed the stranger "
    "who stepped off the morning ferry with a leather case and a map folded into quarters. He "
    "walked past the fish stalls, stopped at the corner of Mill Street to read a faded sign, and "
    "asked the baker for directions to the old lighthouse. The baker wiped his hands on his apron, "
    "pointed up the hill and said that nobody had lived there for twenty years.",
    "To replace the filter, first switch off the pump at the wall and wait five minutes for the "
    "water to settle. Unscrew the clear housing by turning it anticlockwise, and lift out the old "
    "cartridge. Rinse the housing with clean water, but do not use soap, because any residue will "
    "foam when the pump restarts. Check the rubber seal for cracks and replace it if it looks worn. "
    "Slide the new cartridge onto the centre post, screw the housing back on until it is hand tight, "
    "and switch the pump on again. Let it run for ten minutes and check the joints for drips before "
    "you leave it unattended.",
]
# (SmolLM2-135M does not copy a function back reliably: asked to, it explains it, or rewrites it
# into a loop of one phrase, whose drafts would flatter the figure.)
COPY_PROMPTS = [f"Copy this text exactly:\n\n{passage}" for passage in PASSAGES]
CHAT_PROMPTS = [
    "What are three good habits for staying healthy? Answer in a few sentences.",
    "Explain why the sky looks blue during the day.",
]


class SpecSteps:
    """An engine's step observer counting its steps, those that carried drafts, and the look-ups
    made meanwhile (a decode that looks for drafts, found or not, runs without a step planned
    ahead of it): the shares that the expected-gain rule lowers where drafts do not pay."""

    def __init__(self, engine: LLMEngine) -> None:
        self.num_steps = 0
        self.num_verify_steps = 0
        self.num_ahead = 0  # steps with the next one already submitted when they came back (async)
        self._engine = engine
        self._speculator = engine.scheduler.speculator
        self._lookups_before = self._speculator.num_lookups if self._speculator else 0
        self._inner = engine.step_observer
        engine.step_observer = self

    def record_step(self, output, outputs, duration_s, result_wait_s=0.0) -> None:
        if self._inner is not None:
            self._inner.record_step(output, outputs, duration_s, result_wait_s)
        if output.batch.works:
            self.num_steps += 1
            self.num_verify_steps += any(w.num_draft_tokens for w in output.batch.works)
            self.num_ahead += self._engine.num_in_flight > 0

    @property
    def num_lookups(self) -> int:
        return self._speculator.num_lookups - self._lookups_before if self._speculator else 0

    @property
    def verify_share(self) -> float:
        return self.num_verify_steps / self.num_steps if self.num_steps else 0.0

    @property
    def lookup_share(self) -> float:
        """Look-ups per step: at batch 1, the share of steps the request speculated in."""
        return self.num_lookups / self.num_steps if self.num_steps else 0.0

    @property
    def ahead_share(self) -> float:
        """Steps whose successor was planned while they ran (async scheduling kept)."""
        return self.num_ahead / self.num_steps if self.num_steps else 0.0

    def detach(self, engine: LLMEngine) -> None:
        engine.step_observer = self._inner


@dataclass
class Timed:
    seconds: float
    cpu_seconds: float  # this process's, over the same time: what it got of the cores
    outputs: list[list[int]]
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_steps: int = 0
    num_verify_steps: int = 0  # steps with drafts
    num_lookups: int = 0  # decodes that looked for drafts (each ran with no step planned ahead)
    num_backoffs: int = 0  # requests the expected-gain rule turned off
    num_ahead: int = 0  # steps whose successor was planned while they ran (async scheduling)

    @property
    def num_output_tokens(self) -> int:
        return sum(map(len, self.outputs))

    @property
    def output_rate(self) -> float:
        return self.num_output_tokens / self.seconds

    @property
    def cpu_rate(self) -> float:
        """Output tokens per CPU second: steadier than wall time on a machine others load."""
        return self.num_output_tokens / self.cpu_seconds


def spec_config(args) -> SpeculativeConfig:
    """The speculating engine's config: bench_spec's --spec, or with --draft-model a draft_model
    config of the same K (args.spec then says so, for the table's title)."""
    spec = parse_speculative_config(args.spec)
    if args.draft_model:
        args.spec = json.dumps({"method": "draft_model", "model": args.draft_model,
                                "num_speculative_tokens": spec.num_speculative_tokens})
        spec = parse_speculative_config(args.spec)
    return spec


def prompts_of(engine: LLMEngine, workload: str, num_batch: int) -> list[list[int]]:
    texts = {"copy": COPY_PROMPTS, "chat": CHAT_PROMPTS}.get(workload)
    if texts is None:  # batch: copy and chat prompts alternating, each made distinct by its number
        pool = [*COPY_PROMPTS, *CHAT_PROMPTS]
        texts = [f"({i}) {pool[i % len(pool)]}" for i in range(num_batch)]
    return [engine.encode(text, chat=True) for text in texts]


def run_workload(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, *,
                 one_at_a_time: bool) -> Timed:
    """Greedy outputs of `prompts` and the wall time: each prompt alone, or all at once."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    speculator = engine.scheduler.speculator
    counters = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_backoffs")
    before = [getattr(speculator, name) for name in counters] if speculator else []
    steps = SpecSteps(engine)
    start, cpu_start = time.perf_counter(), time.process_time()
    groups = [[p] for p in prompts] if one_at_a_time else [prompts]
    outputs = [r.token_ids for group in groups for r in engine.generate(group, params)]
    timed = Timed(time.perf_counter() - start, time.process_time() - cpu_start, outputs)
    steps.detach(engine)
    timed.num_steps, timed.num_verify_steps, timed.num_lookups = (steps.num_steps, steps.num_verify_steps,
                                                                  steps.num_lookups)
    timed.num_ahead = steps.num_ahead
    for name, value in zip(counters, before, strict=False):  # (none without a speculator)
        setattr(timed, name, getattr(speculator, name) - value)
    return timed


def warm_up(engine: LLMEngine, num_batch: int) -> None:
    """Each workload once, short: a step shape first met while measuring (a verify step of a
    size or dtype not seen yet) would time Triton's compilation, not the step."""
    for workload, max_tokens, alone in (("copy", 24, True), ("chat", 16, True), ("batch", 8, False)):
        run_workload(engine, prompts_of(engine, workload, num_batch)[:1 if alone else None], max_tokens,
                     one_at_a_time=alone)


@dataclass
class Row:
    """One workload on both engines (bench_spec.py's two rows of it)."""

    label: str
    plain: Timed
    spec: Timed

    @property
    def ratio(self) -> float:
        return self.spec.output_rate / self.plain.output_rate

    @property
    def cpu_ratio(self) -> float:
        return self.spec.cpu_rate / self.plain.cpu_rate

    @property
    def cores(self) -> float:
        """The smaller of the two runs' CPU seconds per wall second."""
        return min(self.plain.cpu_seconds / self.plain.seconds, self.spec.cpu_seconds / self.spec.seconds)

    @property
    def is_identical(self) -> bool:
        return self.plain.outputs == self.spec.outputs


def compare_row(plain_engine, spec_engine, workload: str, prompts: list, max_tokens: int,
                alone: bool) -> Row:
    """The workload on the plain engine, then on the speculating one."""
    plain = run_workload(plain_engine, prompts, max_tokens, one_at_a_time=alone)
    spec = run_workload(spec_engine, prompts, max_tokens, one_at_a_time=alone)
    return Row(f"{workload} (batch {1 if alone else len(prompts)})", plain, spec)


def print_rows(rows: list[Row], spec_name: str) -> None:
    """Per workload a plain row and a speculating one: output tok/s, the speculating engine's
    ratio to plain (by wall time, and by this process's CPU time), the steps, the share of them
    whose successor was planned while they ran (async scheduling), the share that carried drafts,
    look-ups per step (at batch 1: the share of steps that speculated, each with no step planned
    ahead), requests backed off by the expected-gain rule, and the drafts' acceptance and tokens
    per verify."""
    print(f"{'workload':<16} {'engine':<6} {'tokens':>7} {'tok/s':>9} {'ratio':>6} {'by CPU':>7} "
          f"{'cores':>6} {'steps':>6} {'ahead':>6} {'verify':>7} {'lookups':>8} {'backoffs':>8} "
          f"{'accept':>7} {'len':>5} {'identical':>9}")
    for row in rows:
        plain = row.plain
        print(f"{row.label:<16} {'plain':<6} {plain.num_output_tokens:>7} {plain.output_rate:>9.1f} "
              f"{'':>6} {'':>7} {'':>6} {plain.num_steps:>6} "
              f"{100 * plain.num_ahead / max(plain.num_steps, 1):>5.0f}%")
        run = row.spec
        steps = max(run.num_steps, 1)
        drafts = f"{'-':>7} {'-':>5}"
        if run.num_drafts:
            drafts = (f"{100 * run.num_accepted_tokens / run.num_draft_tokens:>6.0f}% "
                      f"{1 + run.num_accepted_tokens / run.num_drafts:>5.2f}")
        print(f"{'':<16} {spec_name[:6]:<6} {run.num_output_tokens:>7} {run.output_rate:>9.1f} "
              f"{row.ratio:>5.2f}x {row.cpu_ratio:>6.2f}x {row.cores:>6.2f} {run.num_steps:>6} "
              f"{100 * run.num_ahead / steps:>5.0f}% {100 * run.num_verify_steps / steps:>6.0f}% "
              f"{run.num_lookups / steps:>8.2f} {run.num_backoffs:>8} {drafts} "
              f"{'yes' if row.is_identical else 'NO':>9}")
