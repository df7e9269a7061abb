"""The prompts of `pagedserve bench serve`: random, prefix, sharegpt and jsonl, seeded, with token counts."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedserve.benchmarks import serve, serve_datasets


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return serve_datasets.load_tokenizer(tiny_llama_dir)


def _args(*argv: str) -> argparse.Namespace:
    return serve.add_cli_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_defaults_are_vllms():
    a = _args()
    assert (a.dataset_name, a.num_prompts, a.random_input_len, a.random_output_len, a.random_range_ratio) == (
        "random", 1000, 1024, 128, 0.0)
    assert a.request_rate == float("inf") and a.burstiness == 1.0 and a.max_concurrency is None
    assert a.backend == "openai" and a.endpoint is None and a.seed == 0 and not a.ignore_eos


def test_random_token_ids_are_seeded_with_lengths_in_range(tokenizer):
    vocab = len(tokenizer)
    a = serve_datasets.random_dataset(20, 32, 8, 0.25, vocab, tokenizer, as_text=False, seed=1)
    assert a == serve_datasets.random_dataset(20, 32, 8, 0.25, vocab, tokenizer, as_text=False, seed=1)
    assert a != serve_datasets.random_dataset(20, 32, 8, 0.25, vocab, tokenizer, as_text=False, seed=2)
    low, high = serve_datasets.id_range(vocab)
    for r in a:
        assert 24 <= r.prompt_len == len(r.prompt) <= 40 and 6 <= r.expected_output_len <= 10
        assert all(low <= t < high and isinstance(t, int) for t in r.prompt)
    assert len({r.prompt_len for r in a}) > 1
    exact = serve_datasets.random_dataset(5, 16, 4, 0.0, vocab, tokenizer, as_text=False, seed=0)
    assert [(r.prompt_len, r.expected_output_len) for r in exact] == [(16, 4)] * 5
    with pytest.raises(ValueError, match="range-ratio"):
        serve_datasets.random_dataset(1, 16, 4, 1.0, vocab, tokenizer, as_text=False, seed=0)


def test_random_text_counts_the_re_encoded_tokens(tokenizer):
    for r in serve_datasets.random_dataset(5, 16, 4, 0.0, len(tokenizer), tokenizer, as_text=True, seed=0):
        assert isinstance(r.prompt, str) and r.prompt
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))


def test_prefix_groups_share_their_prefix(tokenizer):
    reqs = serve_datasets.prefix_dataset(12, 20, 5, 3, 7, len(tokenizer), tokenizer, as_text=False, seed=0)
    assert len(reqs) == 12 and all(r.prompt_len == 25 == len(r.prompt) and r.expected_output_len == 7 for r in reqs)
    prefixes = [tuple(r.prompt[:20]) for r in reqs]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 4 for p in set(prefixes))
    assert prefixes[:4] != [prefixes[0]] * 4 or prefixes[4:8] != [prefixes[4]] * 4  # interleaved, not in blocks
    text = serve_datasets.prefix_dataset(4, 20, 5, 2, 7, len(tokenizer), tokenizer, as_text=True, seed=0)
    starts = {r.prompt[:10] for r in text}
    assert len(starts) == 2
    with pytest.raises(ValueError, match="multiple"):
        serve_datasets.prefix_dataset(5, 20, 5, 2, 7, len(tokenizer), tokenizer, as_text=False, seed=0)


def test_sharegpt_takes_the_first_turns_and_filters_like_vllm(tokenizer, tmp_path):
    long = "hello world " * 20
    data = [{"conversations": [{"from": "human", "value": long + str(i)}, {"from": "gpt", "value": long}]}
            for i in range(5)]
    data.append({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long}]})  # < 4 tokens
    data.append({"conversations": [{"from": "human", "value": long}]})  # one turn
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = serve_datasets.sharegpt_dataset(str(path), 5, tokenizer, None, seed=0)
    assert sorted(r.prompt for r in reqs) == sorted(long + str(i) for i in range(5))
    reply_len = len(tokenizer.encode(long, add_special_tokens=False))
    assert all(r.expected_output_len == reply_len for r in reqs)
    assert all(r.expected_output_len == 9 for r in serve_datasets.sharegpt_dataset(str(path), 5, tokenizer, 9, 0))
    with pytest.raises(ValueError, match="only 5 usable"):
        serve_datasets.sharegpt_dataset(str(path), 6, tokenizer, None, seed=0)
    with pytest.raises(ValueError, match="--dataset-path"):
        serve_datasets.sharegpt_dataset(None, 1, tokenizer, None, seed=0)


def test_jsonl_accepts_objects_strings_and_plain_lines(tmp_path, tokenizer):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one", "output_len": 3}\n"two"\nthree words here\n\n{"prompt": [5, 6, 7]}\n')
    reqs = serve_datasets.jsonl_dataset(str(path), 6, 11, None)
    assert [r.prompt for r in reqs] == ["one", "two", "three words here", [5, 6, 7], "one", "two"]
    assert [r.expected_output_len for r in reqs[:4]] == [3, 11, 11, 11]
    assert [r.prompt_len for r in reqs[:4]] == [None, None, None, 3]
    counted = serve_datasets.jsonl_dataset(str(path), 1, 11, tokenizer)
    assert counted[0].prompt_len == len(tokenizer.encode("one", add_special_tokens=False))
