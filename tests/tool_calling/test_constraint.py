"""The tool-choice grammars: required and named admit only valid calls, auto admits free text and completes any
call it starts, and every call's arguments are held to the tool's schema (xgrammar matchers, tiny tokenizer)."""

from __future__ import annotations

import json

import pytest

from pagedserve.structured_output.grammar import GrammarCompiler, new_matcher, validate
from pagedserve.tool_calling.constraint import tool_constraint
from pagedserve.tool_calling.formats import FORMATS
from pagedserve.tool_calling.tools import ToolChoice, check_tools

TOOLS = check_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "integer", "maximum": 14}}, "required": ["zone"],
        "additionalProperties": False}}}])


@pytest.fixture(scope="module")
def compiler(tiny_llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def accepts(compiler, constraint, text: str) -> bool:
    validate(constraint)
    matcher = new_matcher(compiler.compile(constraint))
    return matcher.accept_string(text) and matcher.is_completed()


def call(fmt, name: str, arguments: dict) -> str:
    return fmt.render_call(name, json.dumps(arguments))


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_required_admits_valid_calls_only(compiler, parser):
    fmt = FORMATS[parser]
    required = tool_constraint(TOOLS, ToolChoice("required"), fmt)
    weather, time = call(fmt, "get_weather", {"city": "Paris"}), call(fmt, "get_time", {"zone": 3})
    assert accepts(compiler, required, weather)
    assert accepts(compiler, required, weather + fmt.separator + time)  # parallel calls
    assert not accepts(compiler, required, "Plain text.")
    assert not accepts(compiler, required, call(fmt, "get_time", {"zone": 99}))  # arguments break the schema
    assert not accepts(compiler, required, call(fmt, "get_weather", {"town": "Paris"}))
    assert not accepts(compiler, required, call(fmt, "unknown", {}))
    single = tool_constraint(TOOLS, ToolChoice("required"), fmt, parallel=False)
    assert accepts(compiler, single, weather) and not accepts(compiler, single, weather + fmt.separator + time)


def test_a_named_function_admits_only_that_function(compiler):
    fmt = FORMATS["hermes"]
    named = tool_constraint(TOOLS, ToolChoice("required", "get_time"), fmt)
    assert accepts(compiler, named, call(fmt, "get_time", {"zone": -2}))
    assert not accepts(compiler, named, call(fmt, "get_weather", {"city": "Paris"}))


def test_auto_admits_text_and_completes_a_started_call_under_the_grammar(compiler):
    fmt = FORMATS["hermes"]
    auto = tool_constraint(TOOLS, ToolChoice("auto"), fmt)
    assert accepts(compiler, auto, "Just an answer, no tools.")
    assert accepts(compiler, auto, "Let me look. " + call(fmt, "get_weather", {"city": "Oslo"}))
    matcher = new_matcher(compiler.compile(auto))
    assert matcher.accept_string("Let me look. <tool_call>")  # the model started a call...
    assert not matcher.accept_string("\nnot a call")  # ...so free text is over: only a valid call may follow
    assert matcher.accept_string('\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>')
    assert tool_constraint(TOOLS, ToolChoice("none"), fmt) is None


def test_a_tool_without_parameters_takes_an_empty_object_only(compiler):
    fmt = FORMATS["hermes"]
    bare = check_tools([{"type": "function", "function": {"name": "ping", "parameters": {}}}])
    constraint = tool_constraint(bare, ToolChoice("required"), fmt)
    assert accepts(compiler, constraint, call(fmt, "ping", {}))
    assert not accepts(compiler, constraint, fmt.render_call("ping", '"x"'))
