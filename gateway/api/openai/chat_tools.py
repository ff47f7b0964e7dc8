"""A chat request's tools and response_format -> what the prompt shows, which grammar constrains
the answer, and how calls are read back (the request-level rules; the formats are in tools.py).

- no tools, or tool_choice "none": the tools are left out of the prompt and nothing is parsed;
- "auto" (the default with tools): the model may answer or call; calls are parsed from its text;
- "required": a grammar makes the answer calls (one, or with parallel_tool_calls, the default,
  one to MAX_PARALLEL_TOOL_CALLS) whose arguments fit the function's parameters schema;
- a named function: a grammar makes the answer exactly one call of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.api.openai.schemas import ChatCompletionRequest
from gateway.api.openai.structured import check_schema, response_format_grammar
from gateway.api.openai.tools import tool_call_grammar, tool_format
from gateway.errors import BadRequest
from gateway.tokens.models import ServedModel


@dataclass
class ChatTools:
    definitions: list[dict] | None = None  # the tools shown to the model (None: no tools in play)
    format: str | None = None  # how calls are read back from its text
    forced_names: list[str] | None = None  # required or named: the functions the grammar allows
    is_parallel: bool = True  # may the answer hold several calls


def chat_tools(body: ChatCompletionRequest, model: ServedModel) -> ChatTools:
    tools, choice = body.tools or [], body.tool_choice
    if not getattr(model.tokenizer, "supports_tools", True):
        _refuse_tools(body, model.name)
    if not tools:
        if choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools", param="tool_choice")
        if body.parallel_tool_calls is not None:
            raise BadRequest("parallel_tool_calls needs tools", param="parallel_tool_calls")
        return ChatTools()
    names = [tool.function.name for tool in tools]
    if len(set(names)) < len(names):
        raise BadRequest("tools must have different function names", param="tools")
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            # Checked as compiled: a call's arguments are always held to the schema strictly
            # (xgrammar's structural tags have no non-strict mode), which `strict: false` allows.
            check_schema(tool.function.parameters, f"tools[{i}].function.parameters")
    if choice == "none":
        return ChatTools()
    forced, is_parallel = None, body.parallel_tool_calls is not False
    if choice == "required":
        forced = names
    elif choice not in (None, "auto"):
        if choice.function.name not in names:
            raise BadRequest(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                             param="tool_choice")
        forced, is_parallel = [choice.function.name], False  # as OpenAI: one call of that function
    return ChatTools([tool.model_dump(exclude_none=True) for tool in tools],
                     tool_format(model.chat_template), forced, is_parallel)


def _refuse_tools(body: ChatCompletionRequest, name: str) -> None:
    """A model whose prompt has no tool format here (Qwen v1's ChatML): tools, and the calls and
    results of earlier turns, are refused rather than shown to it in a format it never learnt."""
    if body.tools:
        raise BadRequest(f"model {name!r} does not take tools; send the request without them", param="tools")
    for i, message in enumerate(body.messages):
        if message.role in ("tool", "function") or getattr(message, "tool_calls", None):
            raise BadRequest(f"messages[{i}]: model {name!r} does not take tool calls or results",
                             param="messages")


def chat_grammar(body: ChatCompletionRequest, tools: ChatTools) -> str | None:
    """The grammar spec that constrains the answer, if any."""
    rf_grammar = response_format_grammar(body.response_format)
    if tools.forced_names is None:
        return rf_grammar
    if rf_grammar is not None:
        raise BadRequest("response_format cannot constrain an answer that tool_choice makes a tool call",
                         param="response_format")
    return tool_call_grammar(tools.definitions, tools.forced_names, tools.format, tools.is_parallel)
