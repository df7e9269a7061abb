"""Tool-call formats: calls parsed out of text (hermes, llama3_json), content kept, partial texts hold back what
may still become a call, and the streamed pieces add up to the final parse."""

from __future__ import annotations

import json

import pytest

from pagedserve.tool_calling.formats import FORMATS
from pagedserve.tool_calling.prompt import render_messages
from pagedserve.tool_calling.stream import ToolCallStream
from pagedserve.tool_calling.tools import Tool, ToolError, check_tool_choice, check_tools

HERMES, LLAMA = FORMATS["hermes"], FORMATS["llama3_json"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def test_hermes_calls_and_the_content_before_them():
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    parsed = HERMES.parse(text)
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Paris"}),
                                                                          ("get_weather", {"city": "Oslo"})]
    assert all(c.id.startswith("call_") for c in parsed.calls) and parsed.calls[0].id != parsed.calls[1].id
    assert HERMES.parse("No tools needed.").calls == []
    broken = 'x <tool_call>\n{"name": "get_weather", "arguments": {"city": '
    assert HERMES.parse(broken).content == broken and not HERMES.parse(broken).calls  # cut by max_tokens: text
    cut = HERMES.parse(text + "\n" + broken[2:])  # complete calls, then one cut off: the complete ones stand
    assert [json.loads(c.arguments)["city"] for c in cut.calls] == ["Paris", "Oslo"] and cut.content == "Let me check."


def test_llama3_json_calls_with_parameters_or_arguments():
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}'
    parsed = LLAMA.parse(text)
    assert parsed.content == "" and [(c.name, c.arguments) for c in parsed.calls] == [("a", '{"x": 1}'), ("b", "{}")]
    assert LLAMA.parse("plain answer").calls == []


@pytest.mark.parametrize("fmt", [HERMES, LLAMA])
def test_streamed_content_and_calls_add_up_to_the_final_parse(fmt):
    calls = fmt.separator.join(fmt.render_call(n, json.dumps({"city": c})) for n, c in (("w", "Rome"), ("t", "Kyiv")))
    text = "Sure. " + calls if fmt is HERMES else calls
    stream, content, got = ToolCallStream(fmt), "", []
    for i in range(0, len(text), 3):
        piece, new = stream.feed(text[i:i + 3], finished=i + 3 >= len(text))
        content += piece
        got += new
    final = fmt.parse(text)
    assert content == final.content and [(c.name, c.arguments) for c in got] == [
        (c.name, c.arguments) for c in final.calls]
    assert len({c.id for c in got}) == 2
    assert "<tool" not in content  # a partial trigger was held back, never sent as content


def test_tools_and_tool_choice_are_checked_naming_the_field():
    tools = check_tools([WEATHER])
    assert tools[0].name == "get_weather" and check_tool_choice(None, tools).mode == "auto"
    assert check_tool_choice(None, []).mode == "none"
    named = check_tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools)
    assert (named.mode, named.name) == ("required", "get_weather")
    for bad, param in (([{"type": "retrieval"}], "tools[0]"),
                       ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
                        "tools[0].function.parameters"),
                       ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                         "uniqueItems": True}}}],
                        "tools[0].function.parameters"),
                       ([WEATHER, WEATHER], "tools[1]")):
        with pytest.raises(ToolError) as info:
            check_tools(bad)
        assert info.value.param == param
    for bad in ({"type": "function", "function": {"name": "nope"}}, "sometimes", {"name": "get_weather"}):
        with pytest.raises(ToolError) as info:
            check_tool_choice(bad, tools)
        assert info.value.param == "tool_choice"
    with pytest.raises(ToolError, match="needs tools"):
        check_tool_choice("required", [])


def test_history_is_rendered_for_templates_with_and_without_tools():
    tools = [Tool("get_weather", None, WEATHER["function"]["parameters"])]
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    plain, extra = render_messages(history, tools, HERMES, knows_tools=False)
    assert extra == {} and plain[0]["role"] == "system" and "get_weather" in plain[0]["content"]
    assert plain[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert plain[3] == {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>"}
    hf, extra = render_messages(history, tools, HERMES, knows_tools=True)
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    assert hf[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert hf[2] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}


def test_a_template_that_knows_tools_gets_them_and_the_history_through_its_variables(tiny_llama_dir):
    from transformers import AutoTokenizer

    from pagedserve.tool_calling.prompt import template_knows_tools

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.chat_template = (  # Qwen2.5-style: tools in the system turn, calls and results by role
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
        "</{{ m.role }}>{% endfor %}")
    assert template_knows_tools(tokenizer.chat_template)
    tools = check_tools([WEATHER])
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "warm"}]
    messages, extra = render_messages(history, tools, HERMES, knows_tools=True)
    text = tokenizer.apply_chat_template(messages, tokenize=False, **extra)
    assert '"name": "get_weather"' in text.split("</tools>")[0]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>' in text
    assert "<tool>warm</tool>" in text and "You may call functions" not in text
