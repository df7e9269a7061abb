"""Sampling options seen through the whole engine: seeds, top_k=1, stops, min_tokens, logprobs."""

import math
import random

import pytest

from conftest import assert_no_leaked_blocks
from pagedserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 24)


def ids_prompts(n, seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 390) for _ in range(rng.randint(2, 50))]} for _ in range(n)]


def test_seeded_sample_is_the_same_alone_and_in_any_batch(llm):
    target = ids_prompts(1, seed=1)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(target, params, use_tqdm=False)[0].outputs[0].token_ids
    others = ids_prompts(12, seed=2)
    other_params = [SamplingParams(temperature=0.8, max_tokens=10 + i, ignore_eos=True) for i in range(12)]
    outs = llm.generate(others[:7] + [target] + others[7:], other_params[:7] + [params] + other_params[7:],
                        use_tqdm=False)
    assert outs[7].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate(target, different_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    assert_no_leaked_blocks(llm.engine)


def test_top_k_1_equals_greedy(llm):
    batch = ids_prompts(4, seed=3)
    greedy = llm.generate(batch, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(batch, SamplingParams(temperature=1.3, top_k=1, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in top1] == [o.outputs[0].token_ids for o in greedy]


def test_stop_token_ids_end_generation_and_are_kept(llm):
    prompt = ids_prompts(1, seed=4)[0]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    tokens = free[0].outputs[0].token_ids
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[stop_id]), use_tqdm=False)
    assert out.outputs[0].token_ids == tokens[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id


def test_stop_string_ends_generation_and_is_cut_from_the_text(llm):
    prompt = ids_prompts(1, seed=5)[0]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    text = free[0].outputs[0].text
    stop = text[6:9]
    assert len(stop) == 3 and stop
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
                         use_tqdm=False)
    completion = out.outputs[0]
    assert completion.text == text[:text.index(stop)]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert len(completion.token_ids) < 20
    [kept] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop],
                                                 include_stop_str_in_output=True), use_tqdm=False)
    assert kept.outputs[0].text == text[:text.index(stop) + len(stop)]
    assert_no_leaked_blocks(llm.engine)


def test_min_tokens_holds_back_eos(llm):
    eos = llm.get_tokenizer().eos_token_id
    prompt = ids_prompts(1, seed=6)[0]
    bias = {eos: 100.0}  # eos is by far the most likely token
    [early] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, logit_bias=bias), use_tqdm=False)
    assert early.outputs[0].token_ids == [eos] and early.outputs[0].finish_reason == "stop"
    [held] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, min_tokens=4, logit_bias=bias),
                          use_tqdm=False)
    ids = held.outputs[0].token_ids
    assert len(ids) == 5 and eos not in ids[:4] and ids[4] == eos


def test_logprobs_hold_the_sampled_token_and_top_n(llm):
    prompt = ids_prompts(1, seed=7)[0]
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True),
                         use_tqdm=False)
    completion = out.outputs[0]
    assert len(completion.logprobs) == 5
    total = 0.0
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        assert token_id in position and position[token_id].rank == 1  # greedy: the top token
        assert len(position) == 3
        ranks = sorted(lp.rank for lp in position.values())
        assert ranks == [1, 2, 3]
        values = [lp.logprob for lp in sorted(position.values(), key=lambda lp: lp.rank)]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        total += position[token_id].logprob
    assert math.isclose(completion.cumulative_logprob, total, rel_tol=1e-6)


def test_text_prompts_and_chat_template(llm):
    [out] = llm.generate("Hello, world.", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)
    assert out.prompt == "Hello, world."
    assert out.prompt_token_ids == llm.get_tokenizer().encode("Hello, world.")
    [chat] = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=3, ignore_eos=True),
                      use_tqdm=False)
    assert chat.prompt.startswith("<s>user: Hello</s>") and chat.prompt.endswith("<s>assistant:")
    assert len(chat.outputs[0].token_ids) == 3
