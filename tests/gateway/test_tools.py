"""Tool calls in the model's own formats: rendering (a template that takes tools, the fallback
prompt), the grammar of a forced choice, reading calls back whole and streamed."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from gateway.api.openai.tools import (
    FALLBACK_PROMPT,
    HERMES,
    LLAMA3,
    ToolCallStream,
    parse_tool_calls,
    prompt_messages,
    tool_call_grammar,
    tool_format,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
PARIS_BLOCK = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CONVERSATION = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'}]
# A Qwen2.5-style template in miniature: it renders tools, calls and tool results itself.
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
LLAMA_TEMPLATE = ("{% if tools %}Environment: ipython{% endif %}"
                  "{% for m in messages %}{{ m.content }}{% endfor %}")


def test_formats_are_read_from_the_template():
    assert tool_format(HERMES_TEMPLATE) == HERMES
    assert tool_format(LLAMA_TEMPLATE) == LLAMA3
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") == HERMES  # the fallback
    assert tool_format(None) == HERMES


def test_a_template_that_takes_tools_renders_them_and_the_calls_itself(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    messages, tools = prompt_messages(CONVERSATION, [WEATHER], HERMES_TEMPLATE)
    assert tools == [WEATHER]
    # Arguments as a mapping, as templates expect.
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=HERMES_TEMPLATE, tokenize=False)
    assert '<tools>{"type": "function"' in text and PARIS_BLOCK in text


def test_a_template_without_tools_gets_the_fallback_prompt(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))  # SmolLM2's template knows no tools
    messages, tools = prompt_messages(CONVERSATION, [WEATHER], tokenizer.chat_template)
    assert tools is None
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith(FALLBACK_PROMPT[:30])
    assert json.dumps(WEATHER, separators=(", ", ": ")) in messages[0]["content"]
    assert messages[2]["content"] == PARIS_BLOCK
    assert messages[3] == {"role": "user", "content": '<tool_response>\n{"sky": "sunny"}\n</tool_response>'}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "You are a helpful AI assistant named SmolLM" not in text  # our system prompt replaces its default


def test_hermes_calls_are_parsed_with_the_text_around_them():
    time_block = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    text = f"Let me look.\n{PARIS_BLOCK}\n{time_block}"
    content, calls = parse_tool_calls(text, HERMES)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c["id"] for c in calls}) == 2
    broken = "<tool_call>not json</tool_call>"
    assert parse_tool_calls(broken, HERMES) == (broken, [])
    assert parse_tool_calls("just text", HERMES) == ("just text", [])


def test_llama3_calls_are_parsed():
    content, calls = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {"a": "x;y"}}; '
                                      '{"name": "g", "parameters": {}}', LLAMA3)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"a": "x;y"}), ("g", {})]
    assert parse_tool_calls("The answer is 4.", LLAMA3) == ("The answer is 4.", [])


@pytest.mark.parametrize("pieces", [
    ["Sure. <tool", '_call>\n{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}\n</tool_', "call>"],
    ["Sure. ", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"],
])
def test_a_streamed_hermes_call_comes_out_whole_and_the_text_before_it_as_content(pieces):
    stream = ToolCallStream(HERMES)
    content, calls = "", []
    for piece in pieces:
        text, found = stream.feed(piece)
        content, calls = content + text, calls + found
        assert "<" not in text  # a possible tag start is held back
    text, found = stream.finish()
    content, calls = content + text, calls + found
    assert content == "Sure. "
    (call,) = calls
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_an_unclosed_call_in_a_stream_ends_as_content():
    stream = ToolCallStream(HERMES)
    assert stream.feed("a <tool_call>\n{\"name\"") == ("a ", [])
    assert stream.finish() == ("<tool_call>\n{\"name\"", [])


def test_a_streamed_llama3_answer_is_a_call_or_text():
    call = ToolCallStream(LLAMA3)
    assert call.feed('{"name": "f", ') == ("", [])
    assert call.feed('"parameters": {}}') == ("", [])  # parsed whole, at the end
    text, calls = call.finish()
    assert text == "" and [c["function"]["name"] for c in calls] == ["f"]
    prose = ToolCallStream(LLAMA3)
    assert prose.feed("Hello") == ("Hello", [])


def test_the_forced_choice_grammar_compiles_and_only_allows_the_named_functions(smollm2):
    import xgrammar as xgr

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152, stop_token_ids=[2])
    spec = json.loads(tool_call_grammar([WEATHER], ["get_weather"], HERMES, parallel=False))
    compiled = xgr.GrammarCompiler(info).compile_structural_tag(json.dumps(spec["structural_tag"]))
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string(good) and matcher.accept_token(2) and matcher.is_terminated()
    for bad in ['Hi <tool_call>', '<tool_call>\n{"name": "get_time"', '<tool_call>\n{"name": "get_weather", '
                '"arguments": {"town": ']:
        assert not xgr.GrammarMatcher(compiled).accept_string(bad), bad


def test_arguments_are_the_generated_text_of_the_arguments_object():
    # Re-serialising parsed JSON would change these: key order, spacing, a repeated key.
    for arguments in ['{"unit": "f", "city": "Oslo"}', '{"a":1,"b":[1, 2]}', '{"unit": "c", "unit": "f"}']:
        block = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
        _, (call,) = parse_tool_calls(block, HERMES)
        assert call["function"]["arguments"] == arguments
        stream = ToolCallStream(HERMES)
        _, (streamed,) = stream.feed(block)
        assert streamed["function"]["arguments"] == arguments
    _, (call,) = parse_tool_calls('{"name": "f", "parameters": {"x": 1.50}}', LLAMA3)
    assert call["function"]["arguments"] == '{"x": 1.50}'
    _, (call,) = parse_tool_calls('<tool_call>{"name": "f", "arguments": null}</tool_call>', HERMES)
    assert call["function"]["arguments"] == "{}"


def _forced_matcher(smollm2, names: list[str], parallel: bool):
    from scheduler.grammar import Grammars

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    grammars = Grammars(tokenizer, 49152, [2])
    time_tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    grammars.add("r", tool_call_grammar([WEATHER, time_tool], names, HERMES, parallel), [])
    return grammars._matchers["r"]


def test_a_forced_choice_allows_compact_calls_only_and_a_bounded_number_of_them(smollm2):
    from gateway.api.openai.tools import MAX_PARALLEL_TOOL_CALLS

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    matcher = _forced_matcher(smollm2, ["get_weather", "get_time"], parallel=True)
    assert matcher.accept_string("\n".join([call] * MAX_PARALLEL_TOOL_CALLS))
    assert not matcher.accept_string("\n")  # no room for one more call: only EOS is left
    assert matcher.accept_token(2) and matcher.is_terminated()
    for spaced in ['{\n"city": "Rome"}', '{"city":"Rome"}', '{"city": "Rome" }', '{ "city": "Rome"}']:
        matcher = _forced_matcher(smollm2, ["get_weather"], parallel=True)
        opening = '<tool_call>\n{"name": "get_weather", "arguments": '
        assert not matcher.accept_string(opening + spaced), spaced
    single = _forced_matcher(smollm2, ["get_weather"], parallel=False)
    assert single.accept_string(call) and not single.accept_string("\n")
