"""Constrained decoding in the engine, on the tiny random-weight model: the mask alone makes outputs valid.

Every output that ends with finish_reason "stop" validates against its schema (jsonschema), for 50 seeds,
greedy and sampled; the same requests unconstrained mostly do not parse (the negative control). Regex and
choice outputs match; n=3 gives three valid outputs; free requests batched with constrained ones get what they
get alone; preemption keeps the matcher's state; failures are the one request's ValueError.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from conftest import assert_no_leaked_blocks
from pagedserve import LLM, SamplingParams
from pagedserve.structured_output import StructuredOutputsParams
from pagedserve.structured_output.grammar import GrammarCompiler

SCHEMAS = {
    "enum_and_bounded_integer": {
        "type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                         "count": {"type": "integer", "minimum": -5, "maximum": 99}},
        "required": ["color", "count"], "additionalProperties": False},
    "bounded_strings_and_arrays": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                                  "maxItems": 3}},
        "required": ["name", "tags"], "additionalProperties": False},
    "nested_objects": {
        "type": "object", "properties": {
            "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                       "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["x", "y"], "additionalProperties": False},
            "ok": {"type": "boolean"}},
        "required": ["point", "ok"], "additionalProperties": False},
}
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 24, max_model_len=512)


def params(seed: int, temperature: float, constraint=None, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, structured_outputs=constraint)


def parses_and_validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_fifty_seeds_greedy_and_sampled_all_validate_and_unconstrained_mostly_do_not(llm, name):
    schema = SCHEMAS[name]
    constraint = StructuredOutputsParams(json=schema)
    prompts = [f"Hello {seed}, world." for seed in range(50)]
    for temperature in (0.0, 1.0):
        outs = llm.generate(prompts, [params(s, temperature, constraint) for s in range(50)], use_tqdm=False)
        stopped = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
        assert len(stopped) >= 45  # bounded schemas end well within max_tokens
        for out in stopped:
            assert parses_and_validates(out.text, schema), (ascii(out.text), out.token_ids, temperature)
        free = llm.generate(prompts, [params(s, temperature) for s in range(50)], use_tqdm=False)
        assert sum(parses_and_validates(o.outputs[0].text, schema) for o in free) <= 2
    assert_no_leaked_blocks(llm.engine)


def test_regex_choice_and_grammar_outputs_match(llm):
    regex = StructuredOutputsParams(regex=r"[a-c]{2,4}-[0-9]{3}")
    choice = StructuredOutputsParams(choice=["alpha", "beta \"quoted\"", "gamma\n"])
    ebnf = StructuredOutputsParams(grammar='root ::= "(" digit+ ")"\ndigit ::= [0-9]')
    lark = StructuredOutputsParams(grammar='start: "<" WORD ">"\nWORD: /[a-z]{1,5}/')
    prompts = [f"Prompt {s}" for s in range(12)]
    for constraint, check in ((regex, lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", t)),
                              (choice, lambda t: t in choice.choice),
                              (ebnf, lambda t: re.fullmatch(r"\([0-9]+\)", t)),
                              (lark, lambda t: re.fullmatch(r"<[a-z]{1,5}>", t))):
        outs = llm.generate(prompts, [params(s, 1.0, constraint) for s in range(12)], use_tqdm=False)
        for o in outs:
            if o.outputs[0].finish_reason == "stop":
                assert check(o.outputs[0].text), o.outputs[0].text
        assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 10


def test_json_object_gives_a_json_object(llm):
    outs = llm.generate([f"x {s}" for s in range(10)],
                        [params(s, 1.0, StructuredOutputsParams(json_object=True)) for s in range(10)], use_tqdm=False)
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(o.outputs[0].text), dict)


def test_n_3_gives_three_valid_outputs(llm):
    schema = SCHEMAS["enum_and_bounded_integer"]
    out = llm.generate("Three please", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
                                                      structured_outputs=StructuredOutputsParams(json=schema)),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3 and len({c.text for c in out.outputs}) > 1
    for c in out.outputs:
        assert c.finish_reason == "stop" and parses_and_validates(c.text, schema)


def test_free_requests_batched_with_constrained_ones_get_what_they_get_alone(llm):
    free = [params(s, 0.0 if s % 2 else 1.0, max_tokens=20) for s in range(6)]
    prompts = [f"Free {s}" for s in range(6)]
    alone = llm.generate(prompts, free, use_tqdm=False)
    constraint = StructuredOutputsParams(json=SCHEMAS["nested_objects"])
    mixed = llm.generate(prompts + [f"C {s}" for s in range(6)], free + [params(s, 1.0, constraint) for s in range(6)],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:6]] == [o.outputs[0].token_ids for o in alone]


def test_max_tokens_still_cuts_a_constrained_request_with_length(llm):
    out = llm.generate("x", SamplingParams(temperature=0, max_tokens=3, structured_outputs=StructuredOutputsParams(
        json=SCHEMAS["nested_objects"])), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_preemption_keeps_the_matcher_state(tiny_llama_dir):
    schema = SCHEMAS["bounded_strings_and_arrays"]
    constraint = StructuredOutputsParams(json=schema)
    prompts = [f"Preempt me {s} " * 6 for s in range(8)]
    batch = [params(s, 1.0, constraint) for s in range(8)]
    roomy = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 24, max_model_len=512)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, batch, use_tqdm=False)]
    # 16 blocks of 16 tokens for 8 sequences of ~40-200 tokens: requests are preempted and recomputed.
    tight = LLM(tiny_llama_dir, dtype="float32", max_model_len=256, enable_prefix_caching=False,
                kv_cache_memory_bytes=16 * tight_bytes_per_block(roomy))
    got = tight.generate(prompts, batch, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in got] == want
    for o in got:
        if o.outputs[0].finish_reason == "stop":
            assert parses_and_validates(o.outputs[0].text, schema)
    assert_no_leaked_blocks(tight.engine)


def tight_bytes_per_block(llm) -> int:
    return llm.engine.runner.bytes_per_block


def test_a_constraint_the_library_refuses_is_a_value_error_and_queues_nothing(llm):
    with pytest.raises(ValueError, match="'uniqueItems'"):
        llm.generate("x", params(0, 0.0, StructuredOutputsParams(json={"type": "array", "uniqueItems": True})))
    with pytest.raises(ValueError, match="regex cannot be compiled"):
        llm.generate("x", params(0, 0.0, StructuredOutputsParams(regex="[a-")))
    assert_no_leaked_blocks(llm.engine)


def slow_regex_compiles(monkeypatch, seconds: float) -> None:
    """Make every regex constraint take `seconds` to compile."""
    original = GrammarCompiler.compile

    def slow_for_regex(self, constraint):
        if constraint.kind == "regex":
            time.sleep(seconds)
        return original(self, constraint)

    monkeypatch.setattr(GrammarCompiler, "compile", slow_for_regex)


def test_a_compilation_past_the_time_limit_fails_that_request_alone(tiny_llama_dir, monkeypatch):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 23, max_model_len=256,
              structured_outputs_compile_timeout=0.3)
    slow_regex_compiles(monkeypatch, 1.0)
    engine = llm.engine
    engine.add_request("free", "hello", SamplingParams(temperature=0, max_tokens=30))
    engine.add_request("slow", "hello", params(0, 0.0, StructuredOutputsParams(regex="[0-9]+")))
    free_tokens, error = None, None
    while engine.has_unfinished_requests():
        try:
            for out in engine.step():
                if out.finished and out.request_id == "free":
                    free_tokens = out.outputs[0].token_ids
        except ValueError as e:
            error = e
    assert error is not None and "took longer than 0.3 s" in str(error)
    assert free_tokens is not None and len(free_tokens) == 30  # the other request ran on meanwhile
    assert_no_leaked_blocks(engine)
    # The compilation went on in the background: once it is done, the same constraint is served from the cache.
    time.sleep(1.0)
    out = llm.generate("hello", params(0, 0.0, StructuredOutputsParams(regex="[0-9]+")), use_tqdm=False)[0]
    assert re.fullmatch("[0-9]+", out.outputs[0].text) or out.outputs[0].finish_reason == "length"


def test_chunked_prefill_gives_the_constrained_output_of_one_step_prefill(tiny_llama_dir):
    prompt = "A long prompt that needs several chunks. " * 12
    batch = [params(s, 1.0, StructuredOutputsParams(json=SCHEMAS["nested_objects"])) for s in range(4)]
    whole = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 24, max_model_len=512)
    chunked = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 24, max_model_len=512,
                  max_num_batched_tokens=32)
    want = [o.outputs[0].token_ids for o in whole.generate([prompt] * 4, batch, use_tqdm=False)]
    got = chunked.generate([prompt] * 4, batch, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert all(parses_and_validates(o.outputs[0].text, SCHEMAS["nested_objects"]) for o in got
               if o.outputs[0].finish_reason == "stop")


def test_min_tokens_with_a_constraint_is_refused_naming_it():
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=5, structured_outputs=StructuredOutputsParams(choice=["a"]))


def test_an_aborted_requests_queued_compilation_is_dropped(tiny_llama_dir, monkeypatch):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 23, max_model_len=256)
    slow_regex_compiles(monkeypatch, 0.5)
    engine = llm.engine
    engine.add_request("slow", "hi", params(0, 0.0, StructuredOutputsParams(regex="[0-9]+"), max_tokens=4))
    engine.add_request("aborted", "hi", params(0, 0.0, StructuredOutputsParams(regex="[a-z]+"), max_tokens=4))
    engine.add_request("next", "hi", params(0, 0.0, StructuredOutputsParams(choice=["x", "y"]), max_tokens=4))
    queued = engine.core.scheduler.requests["aborted"].structured_output.future
    engine.abort_request("aborted")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert queued.cancelled()  # never compiled: nothing waited for it
    assert set(done) == {"slow", "next"} and done["next"].outputs[0].text in ("x", "y")
    assert_no_leaked_blocks(engine)
