"""The SSE bytes a stream sends are the bytes the plain way gives: the chunk dict (OpenAI's
chat.completion.chunk / text_completion shape) through json.dumps(ensure_ascii=False,
separators=(",", ":")), framed as `data: ...\\n\\n` -- what the gateway sent before the
per-token templates (gateway/serving/sse.py). Also: the gateway's fast event decode gives
the Delta that protocol.messages' strict decode gives."""

from __future__ import annotations

import json

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.openai.format import ChoiceOutput, ChunkMaker, chat_completion
from gateway.api.requests.api import EventFrames, _event_data, _kind
from gateway.serving.follow import decode_delta
from gateway.serving.plan import ChoicePlan, Plan
from gateway.serving.records import Delta
from gateway.serving.sse import Template, dumps
from gateway.tokens.models import ServedModel
from protocol.messages import ErrorEvent, MessageDecodeError, TokenEvent, decode_event
from shared.sampling import SamplingParams

TEXTS = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)  # no lone surrogates
SAMPLE_TEXTS = ["", " the", "\"quoted\" \\ back", "line\nbreak\ttab\r\x00\x1f\x7f", "é 漢字 😀 \u2028\u2029",
                "</script>", "@hole0-@"]


class _Tokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}\"é>" for i in ids)


def model(name: str = "SmolLM2-135M-Instruct") -> ServedModel:
    return ServedModel(name, "/nowhere", _Tokenizer(), 8192, 49152, created=1700000000)


def plan(api: str, *, n: int = 2, include_usage: bool = False, logprobs: int | None = None,
         echo: bool = False, name: str = "SmolLM2-135M-Instruct") -> Plan:
    choices = [ChoicePlan(i, 0, [1, 2, 3], SamplingParams()) for i in range(n)]
    return Plan(api, model(name), choices, ["Say \"hi\"\n"], [3], include_usage=include_usage,
                logprobs=logprobs, echo=echo, created=1700000123)


def old_frame(data: object, *, event_id: int | None = None, event: str | None = None) -> bytes:
    """The frame as the gateway wrote it before: EventStream.send's code, verbatim."""
    lines = []
    if event_id is not None:
        lines.append(f"id: {event_id}\n")
    if event is not None:
        lines.append(f"event: {event}\n")
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    lines.append(f"data: {text}\n\n")
    return "".join(lines).encode()


def deltas(texts: list[str]) -> list[Delta]:
    out = [Delta(seq, [100 + seq], text) for seq, text in enumerate(texts, start=1)]
    num = len(texts) + 1
    out.append(Delta(num, [7], "end", finish_reason="length", state="completed",
                     usage={"prompt_tokens": 3, "completion_tokens": num, "total_tokens": num + 3}))
    return out


PLANS = [("chat", {}), ("chat", {"include_usage": True}), ("completion", {}), ("completion", {"echo": True}),
         ("completion", {"include_usage": True, "echo": True}), ("chat", {"name": "odd \"name\" é"}),
         ("chat", {"logprobs": 2}), ("completion", {"logprobs": 0})]


@pytest.mark.parametrize(("api", "options"), PLANS)
def test_stream_frames_are_the_bytes_of_the_chunk_dicts(api: str, options: dict) -> None:
    fast = ChunkMaker(plan(api, **options), "chatcmpl-abc")
    plain = ChunkMaker(plan(api, **options), "chatcmpl-abc")
    for index in (0, 1):
        assert fast.opening(index) == plain.opening(index)
        for delta in deltas(SAMPLE_TEXTS):
            if options.get("logprobs") is not None and delta.seq % 2:
                delta.logprobs = [[tid, -0.5, [[tid, -0.5], [9, -1.25e-05]]] for tid in delta.token_ids]
            chunk = plain.delta(index, delta)
            assert fast.delta_frame(index, delta) == (None if chunk is None else old_frame(chunk))
        assert [o.chars for o in fast.text_offsets] == [o.chars for o in plain.text_offsets]  # (logprobs)
    assert fast._templates and all(t is not None for t in fast._templates.values())


@settings(max_examples=200, deadline=None)
@given(texts=st.lists(TEXTS, max_size=6), api=st.sampled_from(["chat", "completion"]), usage=st.booleans())
def test_stream_frames_match_for_any_text(texts: list[str], api: str, usage: bool) -> None:
    fast = ChunkMaker(plan(api, n=1, include_usage=usage), "cmpl-x")
    plain = ChunkMaker(plan(api, n=1, include_usage=usage), "cmpl-x")
    for delta in deltas(texts):
        chunk = plain.delta(0, delta)
        assert fast.delta_frame(0, delta) == (None if chunk is None else old_frame(chunk))


def test_a_chat_chunk_has_openais_shape() -> None:
    chunks = ChunkMaker(plan("chat", n=1, include_usage=True), "chatcmpl-1")
    frame = chunks.delta_frame(0, Delta(1, [5], "Hi"))
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert json.loads(frame[6:]) == {
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000123,
        "model": "SmolLM2-135M-Instruct", "system_fingerprint": None,
        "choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}],
        "usage": None}


def test_a_template_whose_marker_is_not_found_once_is_not_made() -> None:
    assert Template.make(lambda marker: dumps({"a": marker}).encode()) is not None
    assert Template.make(lambda marker: dumps({"a": marker, "b": marker}).encode()) is None
    assert Template.make(lambda marker: b"nothing") is None


@pytest.mark.parametrize("top_n", [0, 2])
def test_request_event_frames_are_the_bytes_of_the_event_dicts(top_n: int) -> None:
    served = model()
    frames = EventFrames("0123abcd", served, top_n)
    events = deltas(SAMPLE_TEXTS)
    events[2].logprobs = [[7, -0.5, [[7, -0.5], [9, -2.0]]]]
    events.append(Delta(99, [], "", error={"code": "dead_letter", "message": "gave up"}, state="failed"))
    for delta in events:
        data = _event_data("0123abcd", delta, served, top_n)
        expected = old_frame(data, event_id=delta.seq, event=_kind(delta))
        assert frames.of(delta) == expected


def _pack(event: dict) -> bytes:
    return msgpack.packb({"v": 1, **event}, use_bin_type=True)


@pytest.mark.parametrize("event", [
    TokenEvent("r1", 3, [5, 6], " hi").encode(),
    TokenEvent("r1", 4, [5], "", logprobs=[[5, -0.5, None]]).encode(),
    TokenEvent("r1", 5, [5], "x", finish_reason="length", usage={"completion_tokens": 5}).encode(),
    TokenEvent("r1", 5, [], "", finish_reason="abort").encode(),
    ErrorEvent("r1", 2, "cancelled", "cancelled by the client").encode(),
    ErrorEvent("r1", 2, "dead_letter", "gave up").encode(),
    _pack({"req_id": "r", "seq": 1, "token_ids": [1], "text": "a"}),
], ids=["plain", "logprobs", "last", "abort", "cancelled", "error", "defaults-left-out"])
def test_the_fast_event_decode_gives_the_strict_decodes_delta(event: bytes) -> None:
    assert decode_delta(event) == Delta.from_event(decode_event(event))


@pytest.mark.parametrize("data", [
    b"\xc1not msgpack", msgpack.packb([1, 2]), _pack({"req_id": "r", "seq": 1, "token_ids": [1]}),
    msgpack.packb({"v": 2, "req_id": "r", "seq": 1, "token_ids": [1], "text": "a", "logprobs": None,
                   "finish_reason": None, "usage": None, "type": "token"}),
    _pack({"req_id": "r", "seq": True, "token_ids": [1], "text": "a", "logprobs": None, "finish_reason": None,
           "usage": None, "type": "token"}),
    _pack({"req_id": "r", "seq": 1, "token_ids": [1.5], "text": "a", "logprobs": None, "finish_reason": None,
           "usage": None, "type": "token"}),
    _pack({"req_id": "r", "seq": 1, "token_ids": [1], "text": "a", "logprobs": None, "finish_reason": None,
           "usage": None, "type": "token", "extra": 1}),
], ids=["garbage", "not-a-map", "no-text", "other-version", "bool-seq", "float-token", "unknown-field"])
def test_the_fast_event_decode_refuses_what_the_strict_decode_refuses(data: bytes) -> None:
    with pytest.raises(MessageDecodeError):
        decode_event(data)
    with pytest.raises(MessageDecodeError):
        decode_delta(data)


def test_usage_reports_the_cached_prompt_tokens_of_each_prompt_once() -> None:
    """Two choices of one prompt: the prompt counts once, with the fewer cached tokens of the two."""
    the_plan = plan("chat", n=2, include_usage=True)
    outputs = [ChoiceOutput(0), ChoiceOutput(1)]
    for out, cached in zip(outputs, (32, 16), strict=True):
        out.add(Delta(1, [7], "x", finish_reason="length", state="completed",
                      usage={"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                             "prompt_tokens_details": {"cached_tokens": cached}}))
    expected = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 16}}
    assert chat_completion(the_plan, "chatcmpl-1", outputs)["usage"] == expected
    assert ChunkMaker(the_plan, "chatcmpl-1").usage(outputs)["usage"] == expected
