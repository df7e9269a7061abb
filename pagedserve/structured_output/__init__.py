"""Structured output: constrained decoding under a JSON schema, a regex, a choice or a grammar (xgrammar).

The front end checks a request's constraint (params.py, schema_check.py, grammar.validate); the engine core
compiles it off the step loop and keeps one matcher per sequence (manager.py); the model runner applies the
step's token bitmask to the constrained rows before sampling. One narrow hook each: SamplingParams
.structured_outputs, Request.structured_output, SchedulerOutput.grammar_bitmask.
"""

from pagedserve.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
