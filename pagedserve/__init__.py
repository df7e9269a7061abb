"""pagedserve: a high-throughput LLM inference engine with a paged KV cache and continuous batching."""

from pagedserve.llm import LLM
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
