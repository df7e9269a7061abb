"""Schemas with keywords xgrammar would silently not enforce are refused, naming the keyword and its place;
what it enforces passes; invalid schemas are refused by the meta-schema."""

from __future__ import annotations

import json
import re

import pytest

from pagedserve.structured_output import StructuredOutputsParams, grammar
from pagedserve.structured_output.schema_check import UNENFORCED, check_json_schema

INTEGER = {"type": "integer"}


@pytest.mark.parametrize("keyword", sorted(UNENFORCED))
def test_each_unenforced_keyword_is_refused_with_its_path(keyword):
    value = {"not": INTEGER, "if": INTEGER, "then": INTEGER, "else": INTEGER, "uniqueItems": True,
             "contains": INTEGER, "maxContains": 2, "minContains": 1, "dependentRequired": {"a": ["b"]},
             "dependentSchemas": {"a": INTEGER}, "dependencies": {"a": ["b"]},
             "patternProperties": {"^x": INTEGER}, "$dynamicRef": "#node"}[keyword]
    schema = {"type": "object", "properties": {"inner": {"type": "array", "items": {keyword: value}}}}
    with pytest.raises(ValueError, match=re.escape(f"'{keyword}' at #/properties/inner/items")):
        check_json_schema(schema)


def test_property_names_that_look_like_keywords_are_not_keywords():
    check_json_schema({"type": "object", "properties": {"not": INTEGER, "if": INTEGER, "contains": INTEGER}})


@pytest.mark.parametrize("schema, match", [
    ({"type": "string", "format": "credit-card"}, "format 'credit-card'"),
    ({"allOf": [INTEGER, {"minimum": 3}]}, "allOf"),
    ({"oneOf": [INTEGER, {"type": "number"}]}, "oneOf"),
    ({"type": "strnig"}, "invalid JSON schema at #/type"),
    ({"type": "object", "required": "a"}, "invalid JSON schema at #/required"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "string", "maxLength": 3, "pattern": "^a+$"}, "maxLength' at # is not enforced together"),
    ({"type": ["string", "null"], "minLength": 2}, "minLength' at # is supported only"),
    ({"maxLength": 2}, "maxLength' at # is supported only"),
    ({"type": "object", "properties": {"a": INTEGER}, "required": ["b"]}, "requires 'b'"),
    (json.loads('{"a": ' * 40 + '{}' + '}' * 40), "nests deeper than 32"),
])
def test_other_unenforced_or_invalid_schemas_are_refused(schema, match):
    with pytest.raises(ValueError, match=match):
        check_json_schema(schema)


@pytest.mark.parametrize("schema", [
    {"oneOf": [{"type": "string"}, INTEGER, {"type": "null"}]},
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}}, "required": ["kind"]},
               {"type": "object", "properties": {"kind": {"const": "b"}, "x": INTEGER}, "required": ["kind"]}]},
    {"allOf": [{"$ref": "#/$defs/A"}], "$defs": {"A": INTEGER}},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                      "n": {"type": "integer", "minimum": 1, "maximum": 9, "multipleOf": 3},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
     "required": ["when"], "additionalProperties": False},
])
def test_enforced_features_pass(schema):
    check_json_schema(schema)
    grammar.validate(StructuredOutputsParams(json=schema))


@pytest.mark.parametrize("params, match", [
    (StructuredOutputsParams(regex="(ab"), "regex cannot be compiled: .*parenthesis"),
    (StructuredOutputsParams(grammar="root ::= foo"), "grammar cannot be compiled: .*foo"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar cannot be compiled"),
    (StructuredOutputsParams(json={"$ref": "#/$defs/missing"}), "json cannot be compiled"),
])
def test_the_library_refusing_a_constraint_is_a_value_error_without_its_log_prefix(params, match):
    with pytest.raises(ValueError, match=match) as info:
        grammar.validate(params)
    assert "/project/" not in str(info.value) and ".cc:" not in str(info.value)


def test_special_tokens_other_than_the_stop_tokens_are_never_allowed(tiny_llama_dir):
    # xgrammar alone reads <unk> and <s> as their text, so a grammar allowing "<unk>" could emit the token.
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    compiler = grammar.GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    matcher = grammar.new_matcher(compiler.compile(StructuredOutputsParams(grammar='root ::= "<" [a-z]+ ">"')))
    bitmask = xgr.allocate_token_bitmask(1, len(tokenizer))
    matcher.fill_next_token_bitmask(bitmask, 0)
    allowed = {t for t in range(len(tokenizer)) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1}
    assert tokenizer.unk_token_id not in allowed and tokenizer.bos_token_id not in allowed
    assert tokenizer.convert_tokens_to_ids("<") in allowed
    assert matcher.accept_string("<abc>")
    matcher.fill_next_token_bitmask(bitmask, 0)
    assert (int(bitmask[0, tokenizer.eos_token_id // 32]) >> (tokenizer.eos_token_id % 32)) & 1  # stop: allowed


def test_json_strings_never_hold_control_characters_or_surrogates(tiny_llama_dir):
    # xgrammar's own string classes allow both (bounded strings: control characters; all: UTF-8 surrogates).
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    compiler = grammar.GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    schema = {"type": "object", "properties": {"short": {"type": "string", "maxLength": 4000},
                                               "free": {"type": "string"}},
              "required": ["short", "free"], "additionalProperties": False}
    compiled = compiler.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True))

    def accepts(value: bytes) -> bool:
        matcher = grammar.new_matcher(compiled)
        return matcher.accept_string(value) and matcher.is_completed()

    assert accepts(b'{"short": "caf\xc3\xa9", "free": "a\\nb"}')
    for bad in (b"\x1a", b"\xed\xa0\x80"):
        assert not accepts(b'{"short": "' + bad + b'", "free": "x"}')
        assert not accepts(b'{"short": "x", "free": "' + bad + b'"}')


def test_json_whitespace_is_bounded_per_gap_and_absent_when_disabled(tiny_llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    compiler = grammar.GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    schema = {"type": "object", "properties": {"a": INTEGER}, "required": ["a"], "additionalProperties": False}

    def accepts(text: str, compact: bool = False) -> bool:
        matcher = grammar.new_matcher(compiler.compile(StructuredOutputsParams(json=schema,
                                                                               disable_any_whitespace=compact)))
        return matcher.accept_string(text) and matcher.is_completed()

    gap = " " * grammar.MAX_WHITESPACE
    assert accepts('{' + gap + '"a": 1}') and not accepts('{' + gap + ' "a": 1}')
    # disable_any_whitespace: no optional whitespace, the fixed separators ", " and ": " (xgrammar's, as vLLM)
    assert accepts('{"a": 1}', compact=True) and not accepts('{ "a": 1}', compact=True)
    assert not accepts('{"a":  1}', compact=True)
