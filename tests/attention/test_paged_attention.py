"""paged_attention on CPU: prefill rows through the C kernel (each token a decode over the cache up to its own
position, AttentionMetadata.per_token) give what the torch SDPA path gives, for fresh prompts, chunked
prefills and prefix-cache hits (both of which read earlier tokens back from the cache)."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.attention import torch_paged


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_through_the_kernel_matches_the_sdpa_path(tiny_llama_dir, monkeypatch, dtype, isa):
    llm = LLM(tiny_llama_dir, dtype=dtype, kv_cache_memory_bytes=1 << 22, max_model_len=256,
              max_num_batched_tokens=40)  # chunks: prompts longer than 40 tokens read their past from the cache
    shared = "Paged attention stores keys and values in blocks " * 3
    prompts = [shared + "and the scheduler batches them.", shared + "so prefixes are cached.",
               "A short one.", "The quick brown fox jumps over the lazy dog " * 2]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)

    def run():
        llm.reset_prefix_cache()
        first = llm.generate(prompts[:1], params, use_tqdm=False)  # the others then hit its cached prefix
        return first + llm.generate(prompts[1:], params, use_tqdm=False)

    kernel = run()
    assert llm.engine.kv_cache_manager.prefix_cache_hits > 0
    if not torch_paged.cpu_decode.supports(torch.zeros(1, 4, 16, dtype=llm.engine.runner.dtype),
                                           llm.engine.runner.kv_caches[0][0]):
        pytest.skip(f"the decode kernel does not take these shapes at {isa}")
    monkeypatch.setattr(torch_paged.cpu_decode, "supports", lambda query, key_cache: False)
    sdpa = run()
    for a, b in zip(kernel, sdpa):
        if dtype == "float32":
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert abs(a.outputs[0].cumulative_logprob - b.outputs[0].cumulative_logprob) < 1e-4
        else:  # bf16 rounds in other places: the first token (the prefill's own output) must agree closely
            assert a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
            first = [next(iter(o.outputs[0].logprobs[0].values())).logprob for o in (a, b)]
            assert abs(first[0] - first[1]) < 0.1
