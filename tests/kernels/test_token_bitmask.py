"""The C token-bitmask kernel bans exactly the tokens whose bit is 0, in the rows it is given, as the torch
fallback does, at every ISA level (the `isa` fixture)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import token_bitmask
from pagedserve.structured_output.bitmask import apply_grammar_bitmask
from pagedserve.structured_output.manager import GrammarBitmask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [100, 128])
def test_banned_tokens_get_minus_inf_in_the_given_rows_only(isa, dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=g, dtype=torch.int32)
    bitmask[0, 0], bitmask[1, 1], bitmask[2, 0] = 0, -1, 0x0f0f0f0f  # none, all, some allowed
    logits = torch.randn(5, vocab, generator=g).to(dtype)
    if not token_bitmask.applies(logits):
        pytest.skip(f"no C compiler at {isa}")
    rows = [4, 0, 2]
    got = logits.clone()
    token_bitmask.apply_token_bitmask(got, bitmask, rows)
    want = logits.clone()
    for i, row in enumerate(rows):
        for token in range(vocab):
            if not (int(bitmask[i, token // 32]) >> (token % 32)) & 1:
                want[row, token] = float("-inf")
    assert torch.equal(got, want)
    fallback = logits.clone().t().contiguous().t()  # not contiguous: the torch path
    assert not token_bitmask.applies(fallback)
    apply_grammar_bitmask(fallback, ["e", "x", "c", "y", "a"], GrammarBitmask({"a": 0, "e": 1, "c": 2}, bitmask))
    assert torch.equal(fallback, want)


def test_a_bitmask_narrower_than_the_vocabulary_is_an_error():
    logits = torch.zeros(1, 64)
    if not token_bitmask.applies(logits):
        pytest.skip("no C compiler")
    with pytest.raises(RuntimeError, match="narrower"):
        token_bitmask.apply_token_bitmask(logits, torch.zeros(1, 1, dtype=torch.int32), [0])
