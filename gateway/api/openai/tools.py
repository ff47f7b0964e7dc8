"""Tools (function calling) for chat: how tools reach the prompt, which grammar enforces a
`required` or named tool choice, and how tool calls are read back from the model's text.

Two tool-call formats, the model's own:
- "hermes" (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call;
- "llama3" (Llama 3.x): the whole answer is `{"name": ..., "parameters": {...}}` (after an
  optional `<|python_tag|>`), several separated by `;`.
A chat template that renders `tools` itself is given them (`apply_chat_template(tools=...)`);
its format is read from the template. A template without tool support (SmolLM2's) gets the
fallback: FALLBACK_PROMPT, a Hermes-style system prompt listing the tools, with earlier calls
and tool results written into the conversation as Hermes blocks.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

HERMES, LLAMA3 = "hermes", "llama3"

FALLBACK_PROMPT = """You can call functions to answer. The functions are listed, as JSON, inside \
<tools></tools>:
<tools>
{tools}
</tools>
To call a function, answer with a <tool_call></tool_call> block holding a JSON object with the \
function's name and its arguments:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}
</tool_call>
A function's result comes back inside <tool_response></tool_response>."""

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template renders a `tools` variable itself."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def tool_format(template: str | None) -> str:
    """The tool-call format a chat template teaches its model (the fallback is Hermes)."""
    if template_takes_tools(template) and (_PYTHON_TAG in template or "ipython" in template):
        return LLAMA3
    return HERMES


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _arguments_object(arguments: str) -> object:
    """A past call's arguments, as templates expect them (a mapping, not its JSON text)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _hermes_block(name: str, arguments: str) -> str:
    call = f'{{"name": {json.dumps(name)}, "arguments": {arguments or "{}"}}}'
    return f"{_HERMES_OPEN}\n{call}\n{_HERMES_CLOSE}"


def prompt_messages(messages: list[dict], tools: list[dict] | None,
                    template: str | None) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for apply_chat_template. `messages` are OpenAI-shaped dicts (an
    assistant's `tool_calls` with JSON-text arguments, `tool` messages with `tool_call_id`)."""
    if template_takes_tools(template):
        out = []
        for message in messages:
            message = dict(message)
            if message.get("tool_calls"):
                message["tool_calls"] = [
                    {"id": c["id"], "type": "function",
                     "function": {"name": c["function"]["name"],
                                  "arguments": _arguments_object(c["function"]["arguments"])}}
                    for c in message["tool_calls"]]
                message.setdefault("content", "")
                if message["content"] is None:
                    message["content"] = ""
            out.append(message)
        return out, tools or None
    return _fallback_messages(messages, tools), None


def _fallback_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    out = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            blocks = [_hermes_block(c["function"]["name"], c["function"]["arguments"])
                      for c in message["tool_calls"]]
            content = "\n".join([content, *blocks] if content else blocks)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools:
        listing = "\n".join(json.dumps(t, separators=(", ", ": ")) for t in tools)
        prompt = FALLBACK_PROMPT.format(tools=listing)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# -- the grammar of a required or named tool choice -------------------------------------------

MAX_PARALLEL_TOOL_CALLS = 8  # calls in one answer of a forced choice with parallel_tool_calls


def tool_call_grammar(tools: list[dict], names: list[str], fmt: str, parallel: bool) -> str:
    """The grammar spec (an xgrammar structural tag) that makes the answer one call, or with
    `parallel` one to MAX_PARALLEL_TOOL_CALLS calls, of the functions in `names`, with arguments
    that fit each function's parameters schema, then the end of the answer. Nothing else may be
    written. The bound matters: a small model, free to add one more call, may add calls until
    max_tokens cuts the answer (and its last call) short. The scheduler makes the arguments'
    JSON compact (scheduler/grammar.py)."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    tags = []
    for name in names:
        schema = by_name[name].get("parameters") or {"type": "object"}
        if fmt == LLAMA3:
            begin, end = f'{{"name": {json.dumps(name)}, "parameters": ', "}"
        else:
            begin = f'{_HERMES_OPEN}\n{{"name": {json.dumps(name)}, "arguments": '
            end = f"}}\n{_HERMES_CLOSE}"
        tags.append({"type": "tag", "begin": begin, "end": end,
                     "content": {"type": "json_schema", "json_schema": schema}})
    call = {"type": "or", "elements": tags}
    answer = call
    if parallel:
        separator = ";" if fmt == LLAMA3 else "\n"
        more = {"type": "sequence", "elements": [{"type": "const_string", "value": separator}, call]}
        answer = {"type": "sequence", "elements": [
            call, {"type": "repeat", "min": 0, "max": MAX_PARALLEL_TOOL_CALLS - 1, "content": more}]}
    structural_tag = {"type": "structural_tag", "format": answer}
    return json.dumps({"type": "structural_tag", "structural_tag": structural_tag})


# -- reading calls back -------------------------------------------------------------------------

_DECODER = json.JSONDecoder()
_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _members(text: str) -> dict[str, tuple[object, str]] | None:
    """A JSON object's members, key -> (value, the value's text exactly as written); None when
    `text` is not one JSON object. The text is kept so that a call's arguments are the bytes the
    model wrote, not a re-serialisation of them (which could differ: key order, duplicates)."""
    def skip(i: int) -> int:
        return _WHITESPACE.match(text, i).end()

    i = skip(0)
    if not text.startswith("{", i):
        return None
    members: dict[str, tuple[object, str]] = {}
    i = skip(i + 1)
    if text.startswith("}", i):
        return members if skip(i + 1) == len(text) else None
    try:
        while True:
            key, i = _DECODER.raw_decode(text, i)
            i = skip(i)
            if not isinstance(key, str) or not text.startswith(":", i):
                return None
            start = skip(i + 1)
            value, i = _DECODER.raw_decode(text, start)
            members[key] = (value, text[start:i])
            i = skip(i)
            if text.startswith("}", i):
                return members if skip(i + 1) == len(text) else None
            if not text.startswith(",", i):
                return None
            i = skip(i + 1)
    except ValueError:
        return None


def _call_of_json(text: str, arguments_key: str) -> dict | None:
    """A call `{"name": ..., "arguments": {...}}` in OpenAI's shape; its arguments are the text of
    the arguments object as generated (a string value is taken as the arguments' JSON text)."""
    members = _members(text)
    if members is None:
        return None
    name = members.get("name", (None, ""))[0]
    if not isinstance(name, str) or not name:
        return None
    found = members.get(arguments_key) or members.get("arguments") or members.get("parameters")
    value, written = found or (None, "{}")
    if value is None:
        written = "{}"
    arguments = value if isinstance(value, str) else written
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[dict]]:
    """(content left around the calls or None, the calls in OpenAI's shape). Text that looks
    like a call but does not parse stays content."""
    if fmt == LLAMA3:
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        if body.startswith("{"):
            calls = [_call_of_json(part, "parameters") for part in _split_llama_calls(body)]
            if calls and all(calls):
                return None, calls
        return text or None, []
    calls, kept, last = [], [], 0
    for match in _HERMES_BLOCK.finditer(text):
        call = _call_of_json(match.group(1), "arguments")
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last:match.start()])
        last = match.end()
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return content or None, calls


def _split_llama_calls(body: str) -> list[str]:
    """`{...}; {...}` -> its objects' texts (a `;` inside a string does not split)."""
    parts, depth, in_string, escaped, start = [], 0, False, False, 0
    for i, char in enumerate(body):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
            continue
        if char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == ";" and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p.strip() for p in parts if p.strip()]


@dataclass
class ToolCallStream:
    """Splits one choice's streamed text into content and whole tool calls: text that may be
    the start of a call is held back until it is known to be one (then it comes out as a call
    when its block closes) or not (then it comes out as content)."""

    fmt: str
    _held: str = ""  # text not yet sent
    _in_call: bool = False  # hermes: inside an open <tool_call> block
    _whole_answer: bool | None = None  # llama3: the answer is a call (None: not known yet)
    num_calls: int = 0
    calls: list[dict] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content to send now, calls completed now)."""
        self._held += text
        return self._llama_feed() if self.fmt == LLAMA3 else self._hermes_feed()

    def finish(self) -> tuple[str, list[dict]]:
        """What is left when the choice ends: an unclosed block is content after all."""
        held, self._held = self._held, ""
        if self.fmt == LLAMA3 and self._whole_answer:
            content, calls = parse_tool_calls(held, LLAMA3)
            return content or "", self._count(calls)
        return held, []

    def _count(self, calls: list[dict]) -> list[dict]:
        self.num_calls += len(calls)
        self.calls += calls
        return calls

    def _hermes_feed(self) -> tuple[str, list[dict]]:
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._held.find(_HERMES_CLOSE)
                if end < 0:
                    return content, self._count(calls)
                block = self._held[:end + len(_HERMES_CLOSE)]
                self._held = self._held[end + len(_HERMES_CLOSE):]
                self._in_call = False
                text, found = parse_tool_calls(block, HERMES)
                if found:
                    calls += found
                    self._held = self._held.lstrip("\n")  # the separator between blocks
                else:
                    content += block
                continue
            start = self._held.find(_HERMES_OPEN)
            if start >= 0:
                content += self._held[:start]
                self._held = self._held[start:]
                self._in_call = True
                continue
            keep = _partial_prefix(self._held, _HERMES_OPEN)
            content += self._held[:len(self._held) - keep]
            self._held = self._held[len(self._held) - keep:]
            return content, self._count(calls)

    def _llama_feed(self) -> tuple[str, list[dict]]:
        if self._whole_answer is None:
            stripped = self._held.lstrip()
            if not stripped:
                return "", []
            if stripped.startswith("{") or stripped.startswith(_PYTHON_TAG):
                self._whole_answer = True
            elif _PYTHON_TAG.startswith(stripped):
                return "", []  # could still be the tag
            else:
                self._whole_answer = False
        if self._whole_answer:
            return "", []  # a call is parsed whole, at the end
        held, self._held = self._held, ""
        return held, []


def _partial_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
