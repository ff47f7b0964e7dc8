"""Grammar-constrained decoding, scheduler side: the grammar lives with its request.

A request whose SamplingParams carry a grammar spec (shared/sampling.py) gets an xgrammar
matcher when it is added. Every step, `mask_filler` picks the constrained rows that sample (no
other row: unconstrained requests pay nothing) and hands the batch a filler
(`StepBatch.mask_filler`); the runner calls it once the step's forward is launched, so the
bitmask is written on the host while the device computes, then masks those rows' logits
(workers/grammar_mask.py) and samples. A Ray group, whose sampling rank is another process,
fills it before the batch is sent. After the step, `accept` advances each matcher by the token
its row drew; a matcher that accepted a stop token has finished its grammar, and so has the
request.

Under async scheduling a constrained request is in every step: step n+1 is planned while step n
runs, its input the token step n samples. That step's mask needs the matcher to have accepted
step n's token first, so the batch samples late (`StepBatch.samples_late`): the runner launches
step n+1's forward, the engine takes step n's constrained rows back first (the matchers accept
their tokens), then calls the filler, uploads the mask and samples step n+1, while its forward
may still run, and only then takes step n's other rows (scheduler/finishing.py). A request that
finished on step n's token (its grammar ended) still has a row in step n+1, whose
result is dropped: its matcher is terminated, and its row is left unmasked.

The fill runs on xgrammar's batch matcher, which releases the GIL, over `fill_threads(rows)`
threads: one below FILL_ROWS_PER_THREAD * 2 rows, more for larger batches, never more than the
cores this process may use (scripts/bench_structured.py measures where threads stop paying).

Jump-forward (`jump_forward=True`, off by default): where the grammar admits a single text
after a request's token (the rest of a key, `": "`, a closing brace), `forced_tokens`
gives that text as tokens and the scheduler appends them unsampled; the next step computes
them with the next sampled token, as a short prefill. The tokens may differ from plain masked
decoding: xgrammar splits the forced text greedily (longest vocabulary token first), where the
model, masked, might have spelt the same text with other tokens and then continued differently;
and a seeded request's later draws shift by the forced tokens (its random stream follows the
output length). The text stays valid under the grammar either way.

The matcher's state is a function of the tokens the request has generated, so:
- preemption changes nothing (the output tokens are kept, only the KV cache is recomputed);
- a scheduler taking a request over (or resuming it after its worker group died) rebuilds the
  matcher by feeding it the tokens already generated, before the first new step.

Compiling a schema against the vocabulary costs milliseconds to seconds; xgrammar's compiler
caches compiled grammars by their spec, so a schema shared by many requests compiles once.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from shared.errors import InvalidRequestError
from shared.logging import get_logger
from shared.step import SequenceWork, TokenBitmask

logger = get_logger(__name__)

# xgrammar's C++ errors start with "[time] /path/file.cc:line: "; users need only the rest.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def compile_error_message(exc: Exception) -> str:
    """xgrammar's reason a grammar does not compile, without the C++ source location."""
    lines = _CPP_PREFIX.sub("", str(exc).strip()).splitlines()
    return lines[0] if lines else type(exc).__name__


_ANY_OBJECT = json.dumps({"type": "object"})


@functools.lru_cache(maxsize=256)
def compact_structural_tag(structural_tag: str) -> str:
    """The structural tag with each `json_schema` content replaced by the EBNF grammar of the
    schema's compact JSON: xgrammar's structural tags allow any whitespace inside JSON, and
    have no switch for it. Cached by text, as forced tool calls resend the same tags."""
    import xgrammar as xgr

    def compact(node: object) -> object:
        if isinstance(node, list):
            return [compact(item) for item in node]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "json_schema" and "json_schema" in node:
            grammar = xgr.Grammar.from_json_schema(json.dumps(node["json_schema"]), any_whitespace=False)
            return {"type": "grammar", "grammar": str(grammar)}
        return {key: compact(value) for key, value in node.items()}

    return json.dumps(compact(json.loads(structural_tag)))


# Fewer rows than this per thread do not pay for a thread's wake-up. Measured on the H200's
# 16-core host (`scripts/bench_structured.py --device cuda`, docs/structured-outputs.md): 64 rows
# fill in 0.14 ms on one thread and 2.0 ms on two; 256 rows in 1.05 ms on one, 0.95 on two and
# 2.6 on four; 512 rows in 1.8 ms on one or two. Threads hardly ever pay, so: one thread, two
# from 512 rows on.
FILL_ROWS_PER_THREAD = 256
MAX_FILL_THREADS = 2


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (a
    container's `--cpus`), which os.cpu_count() and xgrammar's "auto" both ignore."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):  # no cgroup v2 (or not Linux): the affinity is all there is
        return cores
    return cores if quota == "max" else min(cores, max(1, int(quota) // int(period)))


def fill_threads(num_rows: int, cores: int | None = None) -> int:
    """Threads to fill `num_rows` bitmask rows with: one per FILL_ROWS_PER_THREAD rows, at most
    half the cores (the scheduler's own thread and its result writer need the rest), at most
    MAX_FILL_THREADS."""
    cores = available_cores() if cores is None else cores
    return max(1, min(num_rows // FILL_ROWS_PER_THREAD, cores // 2, MAX_FILL_THREADS))


class Grammars:
    """The matchers of the constrained requests of one scheduler (req_id -> matcher)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], *,
                 jump_forward: bool = False, num_fill_threads: int | None = None) -> None:
        """`vocab_size` is the width of the logits (the model's vocabulary, which may have more
        rows than the tokenizer: those padding ids are never allowed). `jump_forward`: see the
        module docstring. `num_fill_threads`: the fill's threads for any batch (None: sized by
        `fill_threads` from the rows and the cores)."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self.jump_forward = jump_forward
        self.num_fill_threads = num_fill_threads
        self._cores = available_cores()
        self._compiler = None  # built by prepare() at start-up, else at the first constrained request
        self._batch_matchers: dict[int, object] = {}  # threads -> xgrammar.BatchGrammarMatcher
        self._matchers: dict[str, object] = {}  # req_id -> xgrammar.GrammarMatcher

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._matchers

    def prepare(self) -> None:
        """Build at start-up what the first constrained request would otherwise wait for: the
        tokenizer's tables over the whole vocabulary and the compiler (seconds for a 128k
        vocabulary), the JSON grammar `json_object` uses, and the batch fill's matcher and
        threads. Does nothing without a tokenizer or where xgrammar is not installed."""
        if self._tokenizer is None:
            return
        try:
            import xgrammar as xgr
        except ImportError:
            return
        started = time.perf_counter()
        grammar = self._compile(json.dumps({"type": "json_object"}))
        # Two matchers through the batch fill (one row is filled alone), so that its threads
        # are started and the bitmask path is warm.
        rows = [xgr.GrammarMatcher(grammar) for _ in range(2)]
        self._fill([0, 1], rows)
        logger.info("grammars_prepared", seconds=round(time.perf_counter() - started, 3),
                    vocab_size=self._vocab_size)

    @property
    def is_prepared(self) -> bool:
        return self._compiler is not None

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, req_id: str, grammar: str | None, output_token_ids: list[int]) -> None:
        """Make the request's matcher (none when `grammar` is None) and replay its output so far.
        Raises InvalidRequestError naming response_format when the grammar does not compile."""
        if grammar is None:
            return
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self._compile(grammar))
        for position, token_id in enumerate(output_token_ids):
            if not matcher.accept_token(token_id):
                raise InvalidRequestError(
                    f"the request's stored output (token {position}) does not follow its grammar",
                    param="response_format")
        self._matchers[req_id] = matcher

    def discard(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)

    def mask_filler(self, works: list[SequenceWork]) -> Callable[[], TokenBitmask] | None:
        """What fills the bitmask of the step's constrained sampled rows when called (after the
        forward is launched: StepBatch.mask_filler); None when the step has no such row. The
        rows are picked now; the bits are those of the matchers' state at the call."""
        if not self._matchers:
            return None
        rows: list[int] = []  # index among the sampled works
        matchers = []
        num_sampled = 0
        for work in works:
            if not work.is_sampled:
                continue
            matcher = self._matchers.get(work.req_id)
            if matcher is not None:
                rows.append(num_sampled)
                matchers.append(matcher)
            num_sampled += 1
        if not rows:
            return None
        return functools.partial(self._fill, rows, matchers)

    def fill(self, works: list[SequenceWork]) -> TokenBitmask | None:
        """The bitmask of the step's constrained sampled rows, now; None when it has none."""
        filler = self.mask_filler(works)
        return filler() if filler is not None else None

    def fill_threads(self, num_rows: int) -> int:
        return self.num_fill_threads or fill_threads(num_rows, self._cores)

    def _fill(self, rows: list[int], matchers: list) -> TokenBitmask:
        import xgrammar as xgr

        bits = xgr.allocate_token_bitmask(len(rows), self._vocab_size)  # int32 [rows, words], CPU
        # A terminated matcher (its request finished on the step before this late-sampled one,
        # whose row is then dropped) has no next token: its row stays all-allowed.
        live = [i for i, matcher in enumerate(matchers) if not matcher.is_terminated()]
        if len(live) == 1:
            matchers[live[0]].fill_next_token_bitmask(bits, live[0])
            return TokenBitmask(rows, bits)
        if not live:
            return TokenBitmask(rows, bits)
        threads = self.fill_threads(len(live))
        batch_matcher = self._batch_matchers.get(threads)
        if batch_matcher is None:
            # Never xgrammar's "auto" (half of std::thread::hardware_concurrency): in a container
            # that is the host's cores, not ours, and too many threads cost more than they save.
            batch_matcher = self._batch_matchers[threads] = xgr.BatchGrammarMatcher(threads)
        if len(live) < len(matchers):
            batch_matcher.batch_fill_next_token_bitmask([matchers[i] for i in live], bits, live)
        else:
            batch_matcher.batch_fill_next_token_bitmask(matchers, bits)  # releases the GIL
        return TokenBitmask(rows, bits)

    def accept(self, req_id: str, token_id: int) -> bool:
        """Advance the request's matcher by its new token; True when its grammar has ended (the
        token was a stop token the grammar allowed there, or, never under the mask, one it
        refused). Unconstrained requests: always False."""
        matcher = self._matchers.get(req_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token_id):
            logger.warning("grammar_refused_token", req_id=req_id, token_id=token_id)
            return True
        return matcher.is_terminated()

    def forced_tokens(self, req_id: str) -> list[int]:
        """With jump_forward: the tokens of the text the request's grammar forces next (not yet
        accepted: the scheduler appends each as if sampled, and `accept` takes it); else []."""
        matcher = self._matchers.get(req_id)
        if not self.jump_forward or matcher is None:
            return []
        return matcher.find_jump_forward_tokens()

    # -- compiling -------------------------------------------------------------------

    def _compile(self, grammar: str):
        spec = json.loads(grammar)
        compiler = self._get_compiler()
        try:
            # Compact JSON everywhere (", " and ": ", no newlines): a small model left free to add
            # whitespace may never stop adding it. xgrammar's builtin JSON grammar allows any.
            if spec["type"] == "json_object":
                return compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False)
            if spec["type"] == "json_schema":
                return compiler.compile_json_schema(json.dumps(spec["schema"]), any_whitespace=False,
                                                    strict_mode=bool(spec.get("strict", True)))
            return compiler.compile_structural_tag(compact_structural_tag(json.dumps(spec["structural_tag"])))
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            raise InvalidRequestError(f"the grammar does not compile: {compile_error_message(exc)}",
                                      param="response_format") from None

    def _get_compiler(self):
        if self._compiler is None:
            if self._tokenizer is None:
                raise InvalidRequestError("structured outputs need a scheduler with a tokenizer",
                                          param="response_format")
            import xgrammar as xgr

            token_bytes = getattr(self._tokenizer, "token_bytes", None)
            if token_bytes is not None:  # a byte-level BPE without a Hugging Face tokenizer (Qwen v1)
                info = xgr.TokenizerInfo(token_bytes(), xgr.VocabType.RAW, vocab_size=self._vocab_size,
                                         stop_token_ids=self._stop_token_ids or None)
            else:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler
