"""A Responses body -> the chat request the fleet runs, and the items a response keeps.

The Responses API is the chat API with another shape: its input items become chat messages
(a `function_call` item an assistant's tool call, a `function_call_output` a tool message),
its flat function tools become chat tools, `text.format` becomes `response_format`. The chat
path (gateway/api/openai/params.py) then does everything else: the chat template, the tool-call
format and grammar, the structured-output grammar, the context-window check. A field of the
input that we cannot serve (an image, a file, a reasoning item, a built-in tool) is refused
here with its full path.

Items are kept normalized (each with an id), as GET /v1/responses/{id}/input_items lists them
and as a response chained after this one sees them.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from pydantic import ValidationError

from gateway.api.openai.schemas import ChatCompletionRequest
from gateway.errors import BadRequest, GatewayError, validation_error

_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_BUILT_IN_TOOLS = ("web_search", "web_search_preview", "file_search", "computer", "computer_use_preview",
                   "code_interpreter", "image_generation", "mcp", "local_shell", "shell", "apply_patch",
                   "custom", "tool_search", "namespace")
_OUTPUT_PART_KEYS = {"type", "text", "annotations", "logprobs"}


def item_id(kind: str, seed: str, index: int) -> str:
    """A stable id for an item that came without one (the same input gets the same ids)."""
    return f"{kind}_" + hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=12).hexdigest()


def _bad(message: str, param: str) -> BadRequest:
    return BadRequest(message, param=param, code="unsupported_value")


def _text_of(content: Any, role: str, param: str) -> str:
    """A message's content (a string or text parts) as one text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{param} must be a string or a list of content parts", param=param)
    wanted = "output_text" if role == "assistant" else "input_text"
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise _bad(f"content of type {kind!r} is not supported: this server serves text models",
                       f"{where}.type")
        if kind == "refusal":
            raise _bad("refusal content is not supported", f"{where}.type")
        if kind not in ("input_text", "output_text"):
            raise BadRequest(f"{where}.type must be {wanted!r}, got {kind!r}", param=f"{where}.type")
        allowed = _OUTPUT_PART_KEYS if kind == "output_text" else {"type", "text"}
        extra = sorted(set(part) - allowed)
        if extra:
            raise _bad(f"unsupported parameter: {where}.{extra[0]}", f"{where}.{extra[0]}")
        if not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}.text must be a string", param=f"{where}.text")
        texts.append(part["text"])
    return "".join(texts)


def _check_keys(item: dict, allowed: set[str], param: str) -> None:
    extra = sorted(set(item) - allowed)
    if extra:
        raise _bad(f"unsupported parameter: {param}.{extra[0]}", f"{param}.{extra[0]}")


def _string(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise BadRequest(f"missing required parameter: {param}.{key} (a string)", param=f"{param}.{key}")
    return value


def normalize_input(value: str | list[dict], seed: str) -> list[dict]:
    """The input as items in OpenAI's shape, each with an id; 400 naming what we cannot serve."""
    if isinstance(value, str):
        return [{"id": item_id("msg", seed, 0), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": value}]}]
    items = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            _check_keys(item, {"type", "role", "content", "id", "status", "phase"}, param)
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise BadRequest(f"{param}.role must be one of {', '.join(_MESSAGE_ROLES)}",
                                 param=f"{param}.role")
            if "content" not in item:
                raise BadRequest(f"missing required parameter: {param}.content", param=f"{param}.content")
            text = _text_of(item["content"], role, f"{param}.content")
            part = "output_text" if role == "assistant" else "input_text"
            content = {"type": part, "text": text} | ({"annotations": []} if role == "assistant" else {})
            items.append({"id": item.get("id") or item_id("msg", seed, i), "type": "message", "role": role,
                          "status": "completed", "content": [content]})
        elif kind == "function_call":
            _check_keys(item, {"type", "id", "call_id", "name", "arguments", "status"}, param)
            items.append({"id": item.get("id") or item_id("fc", seed, i), "type": "function_call",
                          "call_id": _string(item, "call_id", param), "name": _string(item, "name", param),
                          "arguments": _string(item, "arguments", param), "status": "completed"})
        elif kind == "function_call_output":
            _check_keys(item, {"type", "id", "call_id", "output", "status"}, param)
            output = item.get("output")
            if not isinstance(output, str):
                output = _text_of(output, "tool", f"{param}.output")
            items.append({"id": item.get("id") or item_id("fco", seed, i), "type": "function_call_output",
                          "call_id": _string(item, "call_id", param), "output": output,
                          "status": "completed"})
        elif kind is None:
            raise BadRequest(f"missing required parameter: {param}.type", param=f"{param}.type")
        else:
            raise _bad(f"input items of type {kind!r} are not supported (only message, function_call and "
                       "function_call_output)", f"{param}.type")
    if not items:
        raise BadRequest("the input is empty", param="input")
    return items


def chat_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """Items -> chat messages: consecutive function calls join one assistant message (the
    assistant's text just before them too), an output answers its call as a tool message."""
    messages: list[dict] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": item["content"][0]["text"]})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            if kind in _BUILT_IN_TOOLS or isinstance(kind, str):
                raise _bad(f"tools of type {kind!r} are not supported: only function tools (this server "
                           "runs no built-in tools)", f"tools[{i}].type")
            raise BadRequest(f"missing required parameter: tools[{i}].type", param=f"tools[{i}].type")
        _check_keys(tool, {"type", "name", "description", "parameters", "strict"}, f"tools[{i}]")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                    if tool.get(key) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        if choice not in (None, "none", "auto", "required"):
            raise BadRequest("tool_choice must be none, auto, required or {type: function, name}",
                             param="tool_choice")
        return choice
    if choice.get("type") != "function":
        raise _bad(f"tool_choice of type {choice.get('type')!r} is not supported (only function tools)",
                   "tool_choice.type")
    _check_keys(choice, {"type", "name"}, "tool_choice")
    return {"type": "function", "function": {"name": _string(choice, "name", "tool_choice")}}


def response_format(fmt: dict | None) -> dict | None:
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        _check_keys(fmt, {"type"}, "text.format")
        return {"type": kind}
    if kind != "json_schema":
        raise BadRequest("text.format.type must be text, json_object or json_schema",
                         param="text.format.type")
    _check_keys(fmt, {"type", "name", "schema", "description", "strict"}, "text.format")
    spec = {key: fmt[key] for key in ("name", "schema", "description", "strict") if fmt.get(key) is not None}
    return {"type": "json_schema", "json_schema": spec}


# The chat request's parameter names -> the Responses body's, for the errors the chat path raises.
_PARAMS = [
    (re.compile(r"^messages(\[\d+\])?"), "input"),
    (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
    (re.compile(r"^response_format\.json_schema"), "text.format"),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
]


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    for pattern, name in _PARAMS:
        renamed, count = pattern.subn(name, param, count=1)
        if count:
            return renamed
    return param


def renamed(exc: GatewayError) -> GatewayError:
    """The chat path's error, naming the Responses body's field."""
    param = responses_param(exc.param)
    if param != exc.param:
        message = exc.message.replace(exc.param, param) if exc.param else exc.message
        return type(exc)(message, param=param, code=exc.code, headers=exc.headers)
    return exc


def chat_request(body, items: list[dict]) -> ChatCompletionRequest:
    """The chat request that runs a Responses body whose whole context is `items`."""
    fields: dict[str, Any] = {
        "model": body.model, "messages": chat_messages(body.instructions, items),
        "tools": chat_tools(body.tools), "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls if body.tools else None,
        "response_format": response_format(body.text.format if body.text else None),
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "stream": body.stream, "user": body.user,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise renamed(validation_error(exc)) from None
    except GatewayError as exc:
        raise renamed(exc) from None
