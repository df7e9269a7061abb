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
