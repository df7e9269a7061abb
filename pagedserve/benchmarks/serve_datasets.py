"""Prompts for `pagedserve bench serve`: the random, sharegpt, prefix and jsonl datasets.

Every dataset returns a list of `SampleRequest`: the prompt (text, or token ids for /v1/completions), its
length in tokens when known, and how many tokens to ask for. Everything is seeded by `--seed`; nothing is
downloaded.

* random: lengths uniform in [L * (1 - r), L * (1 + r)] (r = `--random-range-ratio`, 0 = exactly L), ids
  uniform in [100, min(49000, vocab)) like `bench throughput`. As text (`--prompt-format text`), the ids are
  decoded and the text re-encoded to count its tokens (a decode/encode round trip may change the count a
  little); as ids (`--prompt-format token-ids`) the server gets exactly these ids.
* sharegpt: a local JSON list of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]};
  the first human turn is the prompt and the length of the reply (in tokens) the output length, unless
  `--sharegpt-output-len`. Pairs with a prompt or reply under 4 tokens, a prompt over 1024 tokens or a total
  over 2048 tokens are skipped (vLLM's filter); conversations are shuffled with the seed.
* prefix: `--prefix-repetition-num-prefixes` groups; in each, prompts share one random prefix of
  `--prefix-repetition-prefix-len` tokens and end in their own random suffix of
  `--prefix-repetition-suffix-len` tokens. Groups are interleaved in random order.
* jsonl: one prompt per line: a JSON object with "prompt" (and optionally "output_len" or "max_tokens"), a
  JSON string, or plain text.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

ID_LOW, ID_HIGH = 100, 49000
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


@dataclass
class SampleRequest:
    prompt: Union[str, list[int]]
    prompt_len: Optional[int]  # tokens; None when no tokenizer was needed to build it
    expected_output_len: int


def id_range(vocab_size: int) -> tuple[int, int]:
    high = min(ID_HIGH, vocab_size)
    return (ID_LOW if high > ID_LOW else 0), high


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _ids_to_prompt(ids: list[int], tokenizer, as_text: bool) -> tuple[Union[str, list[int]], int]:
    if not as_text:
        return ids, len(ids)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return text, len(_encode(tokenizer, text))


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    low = max(1, int(np.floor(mean * (1 - ratio))))
    high = max(low, int(np.ceil(mean * (1 + ratio))))
    return rng.integers(low, high + 1, size=n)


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                   tokenizer, as_text: bool, seed: int) -> list[SampleRequest]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    in_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    low, high = id_range(vocab_size)
    requests = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids = rng.integers(low, high, size=int(n_in)).tolist()
        prompt, prompt_len = _ids_to_prompt(ids, tokenizer, as_text)
        requests.append(SampleRequest(prompt, prompt_len, int(n_out)))
    return requests


def prefix_dataset(num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int,
                   vocab_size: int, tokenizer, as_text: bool, seed: int) -> list[SampleRequest]:
    if num_prefixes < 1 or num_prompts % num_prefixes:
        raise ValueError(f"--num-prompts ({num_prompts}) must be a multiple of --prefix-repetition-num-prefixes "
                         f"({num_prefixes})")
    rng = np.random.default_rng(seed)
    low, high = id_range(vocab_size)
    requests = []
    for _ in range(num_prefixes):
        prefix = rng.integers(low, high, size=prefix_len).tolist()
        if as_text:  # decode the prefix once so that every prompt of the group starts with the same text
            prefix_text = tokenizer.decode(prefix, skip_special_tokens=True)
        for _ in range(num_prompts // num_prefixes):
            suffix = rng.integers(low, high, size=suffix_len).tolist()
            if as_text:
                text = prefix_text + tokenizer.decode(suffix, skip_special_tokens=True)
                requests.append(SampleRequest(text, len(_encode(tokenizer, text)), output_len))
            else:
                requests.append(SampleRequest(prefix + suffix, prefix_len + suffix_len, output_len))
    order = rng.permutation(len(requests))
    return [requests[i] for i in order]


def sharegpt_dataset(path: str, num_prompts: int, tokenizer, output_len: Optional[int],
                     seed: int) -> list[SampleRequest]:
    if not path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a local ShareGPT JSON file)")
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    convs = [d["conversations"] for d in data if isinstance(d, dict) and len(d.get("conversations") or []) >= 2]
    order = np.random.default_rng(seed).permutation(len(convs))
    requests: list[SampleRequest] = []
    for i in order:
        prompt, reply = convs[i][0]["value"], convs[i][1]["value"]
        prompt_len = len(_encode(tokenizer, prompt))
        reply_len = len(_encode(tokenizer, reply)) if output_len is None else output_len
        if prompt_len < SHAREGPT_MIN_LEN or reply_len < SHAREGPT_MIN_LEN:
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT or prompt_len + reply_len > SHAREGPT_MAX_TOTAL:
            continue
        requests.append(SampleRequest(prompt, prompt_len, reply_len))
        if len(requests) == num_prompts:
            break
    if len(requests) < num_prompts:
        raise ValueError(f"{path}: only {len(requests)} usable conversations, --num-prompts is {num_prompts}")
    return requests


def jsonl_dataset(path: str, num_prompts: int, output_len: int, tokenizer) -> list[SampleRequest]:
    if not path:
        raise ValueError("--dataset-name jsonl needs --dataset-path (one prompt per line)")
    requests: list[SampleRequest] = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            try:
                item: Any = json.loads(line)
            except json.JSONDecodeError:
                item = line
            if isinstance(item, dict):
                if "prompt" not in item:
                    raise ValueError(f"{path}: a JSON line without a \"prompt\" field: {line[:80]}")
                prompt = item["prompt"]
                n_out = int(item.get("output_len", item.get("max_tokens", output_len)))
            else:
                prompt, n_out = (item if isinstance(item, str) else line), output_len
            prompt_len = len(_encode(tokenizer, prompt)) if tokenizer is not None and isinstance(prompt, str) else (
                len(prompt) if isinstance(prompt, list) else None)
            requests.append(SampleRequest(prompt, prompt_len, n_out))
            if len(requests) == num_prompts:
                break
    if not requests:
        raise ValueError(f"{path}: no prompts")
    lines = len(requests)
    while len(requests) < num_prompts:  # fewer lines than prompts: go round again
        requests.append(requests[len(requests) % lines])
    return requests


def load_tokenizer(name: Optional[str]):
    """The tokenizer of a HF folder or GGUF file (pagedserve's default model when `name` is None)."""
    from pagedserve.loader.model_loader import open_checkpoint

    if name is not None and not os.path.exists(name):
        raise FileNotFoundError(f"--tokenizer {name}: no such file or folder (nothing is downloaded)")
    return open_checkpoint(name).tokenizer()


def needs_tokenizer(args) -> bool:
    return args.dataset_name in ("random", "prefix", "sharegpt") or args.tokenizer is not None


def build_requests(args, tokenizer) -> list[SampleRequest]:
    as_text = args.prompt_format == "text"
    vocab = len(tokenizer) if tokenizer is not None else None
    if args.dataset_name == "random":
        return random_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                              args.random_range_ratio, vocab, tokenizer, as_text, args.seed)
    if args.dataset_name == "prefix":
        return prefix_dataset(args.num_prompts, args.prefix_repetition_prefix_len,
                              args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
                              args.prefix_repetition_output_len, vocab, tokenizer, as_text, args.seed)
    if args.dataset_name == "sharegpt":
        return sharegpt_dataset(args.dataset_path, args.num_prompts, tokenizer, args.sharegpt_output_len, args.seed)
    if args.dataset_name == "jsonl":
        return jsonl_dataset(args.dataset_path, args.num_prompts, args.jsonl_output_len, tokenizer)
    raise ValueError(f"unknown --dataset-name {args.dataset_name}")
