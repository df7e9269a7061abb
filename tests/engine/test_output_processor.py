"""OutputProcessor: the front end's per-request state, fed core outputs by hand."""

from __future__ import annotations

from transformers import AutoTokenizer

from pagedserve.engine.core_output import EngineCoreOutput
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.sampling_params import SamplingParams


def test_tokens_after_a_stop_string_are_dropped_when_the_core_ran_one_step_ahead(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    hello, world = tokenizer.encode("Hello"), tokenizer.encode(" world")
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, max_tokens=20, stop=["world"], seed=0)
    processor.add_request("r", "Hi", tokenizer.encode("Hi"), params, ["0_r", "1_r"], True, 0.0)
    feed = hello + world
    stopped = []
    for token in feed:
        _, new = processor.process([EngineCoreOutput("0_r", token), EngineCoreOutput("1_r", hello[0])])
        stopped += new
    assert stopped == [("0_r", "world")]
    child = processor.requests["r"].children["0_r"]
    ids_at_stop = list(child.token_ids)
    # The core had already started its next step before it heard of the stop: that token must not count.
    outputs, _ = processor.process([EngineCoreOutput("0_r", hello[0]), EngineCoreOutput("1_r", hello[0])])
    assert child.token_ids == ids_at_stop and child.finish_reason == "stop"
    assert [c.token_ids for c in outputs[0].outputs if c.index == 0] == [[]]


def _stream(processor: OutputProcessor, tokenizer, params: SamplingParams, ids: list[int], stream: bool = True):
    """Feeds `ids` one per step to one request; returns (tokens generated so far, output) per output handed out."""
    processor.add_request("r", "Hi", tokenizer.encode("Hi"), params, ["r"], stream, 0.0)
    handed = []
    for step, token in enumerate(ids, start=1):
        finish = "length" if step == len(ids) else None
        outputs, _ = processor.process([EngineCoreOutput("r", token, finish_reason=finish)])
        handed += [(step, out) for out in outputs]
    return handed


def test_a_stream_interval_sends_the_first_token_then_every_nth_then_the_rest_at_the_finish(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog again", add_special_tokens=False)[:10]
    assert len(ids) == 10
    handed = _stream(OutputProcessor(tokenizer, stream_interval=4), tokenizer, SamplingParams(max_tokens=10), ids)
    assert [step for step, _ in handed] == [1, 5, 9, 10]
    assert [len(out.outputs[0].token_ids) for _, out in handed] == [1, 4, 4, 1]
    assert [t for _, out in handed for t in out.outputs[0].token_ids] == ids
    every_token = _stream(OutputProcessor(tokenizer), tokenizer, SamplingParams(max_tokens=10), ids)
    assert "".join(out.outputs[0].text for _, out in handed) == "".join(out.outputs[0].text for _, out in every_token)
    assert len(every_token) == 10


def test_a_requests_stream_interval_raises_the_engines_and_never_lowers_it(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tokenizer.encode("one two three four five six seven eight nine ten", add_special_tokens=False)[:9]
    raised = _stream(OutputProcessor(tokenizer, stream_interval=2), tokenizer,
                     SamplingParams(max_tokens=9, stream_interval=3), ids)
    assert [step for step, _ in raised] == [1, 4, 7, 9]
    kept = _stream(OutputProcessor(tokenizer, stream_interval=3), tokenizer,
                   SamplingParams(max_tokens=9, stream_interval=2), ids)
    assert [step for step, _ in kept] == [1, 4, 7, 9]
    not_streamed = _stream(OutputProcessor(tokenizer, stream_interval=3), tokenizer, SamplingParams(max_tokens=9),
                           ids, stream=False)
    assert [step for step, _ in not_streamed] == [9] and not_streamed[0][1].outputs[0].token_ids == ids


def test_a_stream_interval_below_one_is_refused_by_name():
    import pytest

    from pagedserve.config import SchedulerConfig

    with pytest.raises(ValueError, match="stream_interval"):
        SamplingParams(stream_interval=0)
    with pytest.raises(ValueError, match="stream_interval"):
        SchedulerConfig(stream_interval=0)
