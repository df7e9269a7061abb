"""pagedserve: a high-throughput LLM inference engine with a paged KV cache and continuous batching."""

from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output.params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "LoRARequest",
           "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in torch and the model code; import it on first use so that `pagedserve --help` and the
    # pure-Python core stay light.
    if name == "LLM":
        from pagedserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
