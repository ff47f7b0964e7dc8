"""OpenAI's response shapes: chat.completion(.chunk), text_completion, logprobs, usage.

Built as plain dicts; shapes.py describes the same shapes for /openapi.json, and
the tests check one against the other. A stream's chunk of a plain text delta (almost every
token) comes from a template of that same dict (gateway/serving/sse.py): the same bytes,
without building and encoding a dict per token.
"""

from __future__ import annotations

import codecs
import math
from dataclasses import dataclass, field

from gateway.api.openai.tools import ToolCallStream, parse_tool_calls
from gateway.serving.plan import Plan
from gateway.serving.records import Delta
from gateway.serving.sse import Template, encode_basestring, frame
from gateway.tokens.models import ServedModel

_UNSET = object()
MISSING_LOGPROB = -9999.0  # what vLLM reports for -inf or an unknown logprob (JSON has no -inf)


def finish_reason_of(delta: Delta) -> str | None:
    """A choice's finish_reason in OpenAI's values (the SDK's types know no other): its own
    when it completed; "length" when it was cancelled (its text is cut short, as by max_tokens:
    the record keeps status "cancelled"); None when it failed or expired with an error, which
    the call reports instead (an error answer, or an error event on a stream)."""
    if delta.state == "completed":
        return delta.finish_reason or "stop"
    if delta.state in ("failed", "expired") and delta.error is not None:
        return None
    return "length"


def _logprob(value: float | None) -> float:
    return MISSING_LOGPROB if value is None or not math.isfinite(value) else float(value)


def chat_logprobs(model: ServedModel, entries: list, top_n: int) -> list[dict]:
    """Wire entries [token_id, logprob, [[id, logprob], ...]] -> chat "content" items. `bytes`
    are the token's own (a choice's concatenated bytes are its text's UTF-8)."""
    items = []
    for token_id, logprob, top in entries:
        items.append({
            "token": model.token_text(token_id), "logprob": _logprob(logprob),
            "bytes": list(model.token_bytes(token_id)),
            "top_logprobs": [
                {"token": model.token_text(tid), "logprob": _logprob(lp),
                 "bytes": list(model.token_bytes(tid))}
                for tid, lp in (top or [])[:top_n]
            ],
        })
    return items


class TextOffsets:
    """Where each token's text starts in its choice's text, in characters (completions'
    `text_offset`), counted from the tokens' own bytes: a token that ends inside a character
    adds no character; the token that completes it adds the character."""

    def __init__(self, start: int = 0) -> None:
        self.chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, data: bytes) -> int:
        """The offset of the token of these bytes; then counts its characters."""
        offset = self.chars
        self.chars += len(self._decoder.decode(data))
        return offset


def completion_logprobs(model: ServedModel, entries: list, top_n: int, offsets: TextOffsets,
                        num_unscored: int = 0) -> dict:
    """The legacy completions shape; `offsets` goes on from the choice's earlier tokens. The first
    `num_unscored` entries (an echoed prompt's first token) have a null logprob and top."""
    tokens, token_logprobs, tops, text_offsets = [], [], [], []
    for i, (token_id, logprob, top) in enumerate(entries):
        tokens.append(model.token_text(token_id))
        if i < num_unscored:
            token_logprobs.append(None)
            tops.append(None)
        else:
            token_logprobs.append(_logprob(logprob))
            tops.append({model.token_text(tid): _logprob(lp) for tid, lp in (top or [])[:top_n]}
                        if top_n else None)
        text_offsets.append(offsets.next(model.token_bytes(token_id)))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": text_offsets}


def vllm_prompt_logprobs(model: ServedModel, entries: list | None, top_n: int) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token null (the first) or {token id: {logprob, rank,
    decoded_token}} holding the token itself and the top N (ranked 1..N)."""
    if entries is None:
        return None
    out: list = []
    for i, (token_id, logprob, top) in enumerate(entries):
        if i == 0:
            out.append(None)
            continue
        ranked = (top or [])[:top_n]
        rank = next((r for r, (tid, _) in enumerate(ranked, start=1) if tid == token_id), None)
        item = {str(token_id): {"logprob": _logprob(logprob), "rank": rank,
                                "decoded_token": model.token_text(token_id)}}
        for r, (tid, lp) in enumerate(ranked, start=1):
            item.setdefault(str(tid), {"logprob": _logprob(lp), "rank": r,
                                       "decoded_token": model.token_text(tid)})
        out.append(item)
    return out


@dataclass
class ChoiceOutput:
    """One choice's output, gathered delta by delta."""

    index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    error: dict | None = None
    state: str | None = None
    cached_tokens: int = 0  # prompt tokens its scheduler found in the prefix cache
    prompt_logprobs: list | None = None  # [token_id, logprob, top] per prompt token, when asked for

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        if delta.logprobs:
            self.logprobs += delta.logprobs
        self.count(delta)

    def count(self, delta: Delta) -> None:
        """What a stream keeps of a delta (its text and logprobs went to the client already)."""
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_tokens += len(delta.token_ids)
        if delta.is_final:
            self.state = delta.state
            self.error = delta.error
            self.cached_tokens = cached_tokens_of(delta.usage)
            self.finish_reason = finish_reason_of(delta)


def cached_tokens_of(usage: dict | None) -> int:
    """usage.prompt_tokens_details.cached_tokens of a scheduler's usage record (0 if absent)."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", 0)
    return cached if isinstance(cached, int) else 0


def usage(plan: Plan, outputs: list[ChoiceOutput]) -> dict:
    """Each prompt counted once however many choices it has (as OpenAI does); its cached
    tokens are the fewest any of its choices got, so none claims more than it had."""
    prompt = sum(plan.num_prompt_tokens)
    completion = 0 if plan.is_prompt_only else sum(o.num_tokens for o in outputs)
    prompt_index_of = {choice.index: choice.prompt_index for choice in plan.choices}
    cached_per_prompt: dict[int, int] = {}
    for out in outputs:
        prompt_index = prompt_index_of.get(out.index, out.index)
        cached_per_prompt[prompt_index] = min(cached_per_prompt.get(prompt_index, out.cached_tokens),
                                              out.cached_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached_per_prompt.values())}}


def chat_completion(plan: Plan, response_id: str, outputs: list[ChoiceOutput]) -> dict:
    choices = []
    for out in outputs:
        logprobs = None
        if plan.logprobs is not None:
            logprobs = {"content": chat_logprobs(plan.model, out.logprobs, plan.logprobs)}
        message = chat_message(plan, out.text)
        finish_reason = out.finish_reason
        if message.get("tool_calls") and finish_reason == "stop":
            finish_reason = "tool_calls"
        choices.append({"index": out.index, "message": message, "logprobs": logprobs,
                        "finish_reason": finish_reason})
    body = {"id": response_id, "object": "chat.completion", "created": plan.created,
            "model": plan.served_name, "system_fingerprint": None, "choices": choices,
            "usage": usage(plan, outputs)}
    if plan.prompt_logprobs is not None and outputs:  # vLLM's: one prompt, on the response
        body["prompt_logprobs"] = vllm_prompt_logprobs(plan.model, outputs[0].prompt_logprobs,
                                                       plan.prompt_logprobs)
    return body


def chat_message(plan: Plan, text: str) -> dict:
    """The assistant's message: its text, or with tools in play its calls and the text around them."""
    if plan.tool_format is None:
        return {"role": "assistant", "content": text}
    content, calls = parse_tool_calls(text, plan.tool_format)
    if plan.is_tool_choice_forced:
        content = None  # all the grammar allowed is calls: text left over is a call max_tokens cut
    elif not calls:
        return {"role": "assistant", "content": text}
    if not plan.parallel_tool_calls:
        calls = calls[:1]
    return {"role": "assistant", "content": content, "tool_calls": calls or None}


def text_completion(plan: Plan, response_id: str, outputs: list[ChoiceOutput]) -> dict:
    choices = []
    for out in outputs:
        prefix = plan.prompt_texts[plan.choices[out.index].prompt_index] if plan.echo else ""
        text, entries, finish_reason = out.text, out.logprobs, out.finish_reason
        if plan.is_prompt_only:  # the token made to score the prompt is not the client's
            text, entries = "", []
            finish_reason = "length" if out.finish_reason in ("stop", "length") else out.finish_reason
        logprobs = None
        if plan.logprobs is not None and plan.echo:  # the prompt's tokens, then the output's
            logprobs = completion_logprobs(plan.model, (out.prompt_logprobs or []) + entries, plan.logprobs,
                                           TextOffsets(0), num_unscored=1)
        elif plan.logprobs is not None:
            logprobs = completion_logprobs(plan.model, entries, plan.logprobs, TextOffsets(len(prefix)))
        choice = {"index": out.index, "text": prefix + text, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        if plan.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(plan.model, out.prompt_logprobs,
                                                             plan.prompt_logprobs)
        choices.append(choice)
    return {"id": response_id, "object": "text_completion", "created": plan.created,
            "model": plan.served_name, "system_fingerprint": None, "choices": choices,
            "usage": usage(plan, outputs)}


def _without_output(delta: Delta) -> Delta:
    """A delta of an echo with max_tokens 0: its end only, as a length finish."""
    finish = "length" if delta.finish_reason in ("stop", "length") else delta.finish_reason
    return Delta(delta.seq, [], "", None, finish, delta.usage, delta.error, delta.state)


class ChunkMaker:
    """The chunks of one streamed call, choice by choice, delta by delta."""

    def __init__(self, plan: Plan, response_id: str) -> None:
        self.plan = plan
        self.response_id = response_id
        self.is_chat = plan.api == "chat"
        self.object = "chat.completion.chunk" if self.is_chat else "text_completion"
        self.text_offsets = [TextOffsets() for _ in plan.choices]  # choice -> its tokens' (logprobs)
        self._templates: dict[int, Template | None] = {}  # choice -> frame of a plain text delta
        # With tools in play: choice -> its text split into content and calls, calls sent so far.
        self._tool_streams = None
        if plan.tool_format is not None:
            self._tool_streams = [ToolCallStream(plan.tool_format) for _ in plan.choices]
            self._num_calls_sent = [0] * len(plan.choices)
        # Echo with logprobs: the prompt's chunk waits for its logprobs (on the first token's delta).
        self._is_echo_deferred = [plan.echo and plan.logprobs is not None] * len(plan.choices)
        self.num_completion_tokens = 0  # so far, all choices: continuous usage

    def _chunk(self, choice: dict) -> dict:
        chunk = {"id": self.response_id, "object": self.object, "created": self.plan.created,
                 "model": self.plan.served_name, "system_fingerprint": None, "choices": [choice]}
        if self.plan.continuous_usage:
            prompt = sum(self.plan.num_prompt_tokens)
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": self.num_completion_tokens,
                              "total_tokens": prompt + self.num_completion_tokens}
        elif self.plan.include_usage:
            chunk["usage"] = None
        return chunk

    def opening(self, index: int) -> dict | None:
        """What a choice starts with: the assistant role (chat) or the echoed prompt."""
        if self.plan.api == "chat":
            # With tools in play the answer may be calls only, whose message has content null
            # (the SDK's accumulated message keeps the first content it is sent, "" included).
            content = None if self.plan.tool_format is not None else ""
            return self._chunk({"index": index, "delta": {"role": "assistant", "content": content},
                                "logprobs": None, "finish_reason": None})
        if self.plan.echo and not self._is_echo_deferred[index]:
            prefix = self.plan.prompt_texts[self.plan.choices[index].prompt_index]
            self.text_offsets[index] = TextOffsets(len(prefix))
            return self._chunk({"index": index, "text": prefix, "logprobs": None, "finish_reason": None})
        return None

    def _echo_with_logprobs(self, index: int, prompt_entries: list) -> bytes:
        """The echoed prompt's chunk, its tokens' logprobs with it (the first one's null)."""
        self._is_echo_deferred[index] = False
        prefix = self.plan.prompt_texts[self.plan.choices[index].prompt_index]
        offsets = TextOffsets(0)
        logprobs = completion_logprobs(self.plan.model, prompt_entries, self.plan.logprobs, offsets,
                                       num_unscored=1)
        self.text_offsets[index] = offsets  # the output's tokens go on from the prompt's
        return frame(self._chunk({"index": index, "text": prefix, "logprobs": logprobs,
                                  "finish_reason": None}))

    def delta(self, index: int, delta: Delta) -> dict | None:
        """The chunk of one delta; None when it carries nothing a client would see."""
        finish = finish_reason_of(delta) if delta.is_final else None
        wants_logprobs = self.plan.logprobs is not None and bool(delta.logprobs)
        if not delta.text and finish is None and not wants_logprobs:
            return None
        logprobs = None
        if self.plan.api == "chat":
            if wants_logprobs:
                logprobs = {"content": chat_logprobs(self.plan.model, delta.logprobs, self.plan.logprobs)}
            content = {"content": delta.text} if delta.text or finish is None else {}
            return self._chunk({"index": index, "delta": content, "logprobs": logprobs,
                                "finish_reason": finish})
        if wants_logprobs:
            logprobs = completion_logprobs(self.plan.model, delta.logprobs, self.plan.logprobs,
                                           self.text_offsets[index])
        return self._chunk({"index": index, "text": delta.text, "logprobs": logprobs,
                            "finish_reason": finish})

    def delta_frame(self, index: int, delta: Delta) -> bytes | None:
        """delta()'s chunk as an SSE frame, after the echoed prompt's when it waited for this
        delta's prompt logprobs. With max_tokens 0 the delta's output is dropped (the token made
        to score the prompt is not the client's)."""
        echo = b""
        if self._is_echo_deferred[index] and (delta.prompt_logprobs is not None or delta.is_final):
            echo = self._echo_with_logprobs(index, delta.prompt_logprobs or [])
        if self.plan.is_prompt_only:
            delta = _without_output(delta)
        self.num_completion_tokens += len(delta.token_ids)
        body = self._delta_frame(index, delta)
        return echo + body if body is not None else (echo or None)

    def _delta_frame(self, index: int, delta: Delta) -> bytes | None:
        """delta()'s chunk as an SSE frame. A plain text delta (not the last, no logprobs to
        show) is the choice's template with the text put in: the same bytes, built faster."""
        if self._tool_streams is not None:
            return self._tool_frames(index, delta)
        if delta.text and delta.state is None and (self.plan.logprobs is None or not delta.logprobs) \
                and not self.plan.continuous_usage:  # (usage changes with every chunk)
            template = self._templates.get(index, _UNSET)
            if template is _UNSET:
                template = Template.make(lambda marker: self._frame_of_text(index, marker))
                self._templates[index] = template
            if template is not None:
                return template.fill(encode_basestring(delta.text))
        chunk = self.delta(index, delta)
        return None if chunk is None else frame(chunk)

    def _tool_frames(self, index: int, delta: Delta) -> bytes | None:
        """A delta's chunks when its text may hold tool calls: content as it is known to be
        content; each call, when its block closes, as OpenAI streams one (a chunk with its id
        and name, then one with its arguments); the finish reason last, in a chunk of its own."""
        stream = self._tool_streams[index]
        content, calls = stream.feed(delta.text)
        finish = None
        if delta.is_final:
            rest, more = stream.finish()
            content, calls = content + rest, calls + more
            finish = finish_reason_of(delta)
        chunks = []
        if content and not self.plan.is_tool_choice_forced:  # forced: leftovers are a cut call
            chunks.append({"content": content})
        for call in calls:
            k = self._num_calls_sent[index]
            if k >= 1 and not self.plan.parallel_tool_calls:
                break
            self._num_calls_sent[index] += 1
            function = call["function"]
            chunks.append({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                           "function": {"name": function["name"], "arguments": ""}}]})
            chunks.append({"tool_calls": [{"index": k, "function": {"arguments": function["arguments"]}}]})
        if finish == "stop" and self._num_calls_sent[index]:
            finish = "tool_calls"
        logprobs = None
        if self.plan.logprobs is not None and delta.logprobs:
            logprobs = {"content": chat_logprobs(self.plan.model, delta.logprobs, self.plan.logprobs)}
        if logprobs is not None and not chunks:
            chunks.append({})
        frames = [frame(self._chunk({"index": index, "delta": body, "logprobs": logprobs if i == 0 else None,
                                     "finish_reason": None}))
                  for i, body in enumerate(chunks)]
        if finish is not None:
            frames.append(frame(self._chunk({"index": index, "delta": {}, "logprobs": None,
                                             "finish_reason": finish})))
        return b"".join(frames) if frames else None

    def _frame_of_text(self, index: int, text: str) -> bytes:
        return frame(self.delta(index, Delta(0, [], text)))

    def usage(self, outputs: list[ChoiceOutput]) -> dict:
        return {"id": self.response_id, "object": self.object, "created": self.plan.created,
                "model": self.plan.served_name, "system_fingerprint": None, "choices": [],
                "usage": usage(self.plan, outputs)}
