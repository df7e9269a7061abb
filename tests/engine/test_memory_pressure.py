"""Memory pressure on the server's engine: a KV pool that holds two of these requests at a time, and 100 long
ones arriving together. All finish (no livelock: the preempted ones are recomputed and make progress), with the
tokens an unpressured engine gives, and every block comes back."""

from __future__ import annotations

import asyncio
import random

from conftest import assert_no_leaked_blocks
from pagedserve import LLM, SamplingParams
from pagedserve.engine.async_llm import AsyncLLM

PARAMS = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def long_prompts(n: int, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 390) for _ in range(rng.randint(50, 70))]} for _ in range(n)]


async def run_all(engine: AsyncLLM, prompts: list[dict]) -> list[list[int]]:
    async def one(i: int, prompt: dict) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(prompt, PARAMS, request_id=f"pressure-{i}"):
            tokens += out.outputs[0].token_ids
        return tokens
    return await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), timeout=300)


def test_100_long_requests_on_a_pool_for_two_all_finish_with_unpressured_outputs(tiny_llama_dir):
    prompts = long_prompts(100)
    roomy = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 24)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, PARAMS, use_tqdm=False)]
    block_bytes = roomy.engine.runner.bytes_per_block
    # A request needs up to (70 + 48) / 16 = 8 blocks: 16 blocks hold two at a time.
    engine = AsyncLLM.from_kwargs(model=tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=16 * block_bytes,
                                  max_model_len=128)
    try:
        assert engine.info.num_blocks == 16
        got = asyncio.run(run_all(engine, prompts))
        assert got == expected
        stats = engine.core_stats()
        assert stats.num_preemptions_total > 0
        assert_no_leaked_blocks(engine)
    finally:
        engine.shutdown()
