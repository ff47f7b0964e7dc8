"""Grammar-constrained decoding, scheduler side: the grammar lives with its request.

A request whose SamplingParams carry a grammar spec (shared/sampling.py) gets an xgrammar
matcher when it is added. Every step, `fill` writes the token bitmask of the constrained rows
that sample (and of no other row: unconstrained requests pay nothing) and the batch carries it
to the rank that samples, which masks those rows' logits (workers/grammar_mask.py). After the
step, `accept` advances each matcher by the token its row drew; a matcher that accepted a stop
token has finished its grammar, and so has the request.

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
import re

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


class Grammars:
    """The matchers of the constrained requests of one scheduler (req_id -> matcher)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        """`vocab_size` is the width of the logits (the model's vocabulary, which may have more
        rows than the tokenizer: those padding ids are never allowed)."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler = None  # built at the first constrained request (it reads the whole vocab)
        self._batch_matcher = None
        self._matchers: dict[str, object] = {}  # req_id -> xgrammar.GrammarMatcher

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._matchers

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

    def fill(self, works: list[SequenceWork]) -> TokenBitmask | None:
        """The bitmask of the step's constrained sampled rows; None when it has none."""
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
        import xgrammar as xgr

        bits = xgr.allocate_token_bitmask(len(rows), self._vocab_size)  # int32 [rows, words], CPU
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bits, 0)
        else:
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher()
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bits)
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

            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                      stop_token_ids=self._stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler
