"""Building a fast HF tokenizer from a GGUF file's tokenizer metadata (byte-level BPE and SentencePiece-style)."""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

logger = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# ---------------------------------------------------------------------------------------------
# Tokenizer construction
# ---------------------------------------------------------------------------------------------

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> pre-tokenizer. These mirror llama.cpp's regexes for each pre type (which
# it copied from each model's tokenizer.json), so text is split where the merges were learned.
_DIGIT_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_STYLE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral")
_QWEN2_STYLE = ("qwen2", "deepseek-r1-qwen")


def _byte_level_pre_tokenizer(pre: Optional[str]) -> pre_tokenizers.PreTokenizer:
    if pre in _DIGIT_THEN_GPT2:
        split: list = [pre_tokenizers.Digits(individual_digits=True)]
        regex = _GPT2_SPLIT
    elif pre in _LLAMA3_STYLE:
        split, regex = [], _LLAMA3_SPLIT
    elif pre in _QWEN2_STYLE:
        split, regex = [], _QWEN2_SPLIT
    else:
        if pre not in (None, "default", "gpt2", "gpt-2"):
            logger.warning("GGUF tokenizer pre-type %r is unknown; splitting text like GPT-2", pre)
        split, regex = [], _GPT2_SPLIT
    split.append(pre_tokenizers.Split(Regex(regex), behavior="isolated"))
    # use_regex=False: the Split above already did the splitting; ByteLevel only maps bytes.
    return pre_tokenizers.Sequence(split + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: Optional[str]) -> Tokenizer:
    """GPT-2 style byte-level BPE ("gpt2" in llama.cpp): tokens are already in the byte alphabet."""
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    # llama.cpp (and Llama 3's tokenizer.json) take a word that is itself a token whole.
    bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _LLAMA3_STYLE)
    tokenizer = Tokenizer(bpe)
    if pre in _QWEN2_STYLE:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _merges_from_scores(tokens: list[str], scores: np.ndarray, types: np.ndarray) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    ranked by the merged token's score (SentencePiece BPE merges the best-scoring pair first)."""
    vocab = {token: index for index, token in enumerate(tokens) if types[index] == TOKEN_NORMAL}
    ranked = []
    for token, index in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[index]), vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(tokens: list[str], scores: np.ndarray, types: np.ndarray, add_space_prefix: bool) -> Tokenizer:
    """SentencePiece BPE ("llama" in llama.cpp), with byte fallback, like HF's LlamaTokenizerFast."""
    vocab = {token: index for index, token in enumerate(tokens)}
    unk = next((tokens[i] for i in range(len(tokens)) if types[i] == TOKEN_UNKNOWN), None)
    bpe = models.BPE(
        vocab=vocab,
        merges=_merges_from_scores(tokens, scores, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    # SentencePiece writes spaces as U+2581 and (usually) prefixes the text with one.
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer
