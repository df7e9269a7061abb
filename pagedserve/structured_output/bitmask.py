"""Applying a step's grammar bitmask to the logits of its constrained rows (the model runner's one call)."""

from __future__ import annotations

import torch

from pagedserve.kernels import token_bitmask
from pagedserve.structured_output.manager import GrammarBitmask

_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_grammar_bitmask(logits: torch.Tensor, request_ids: list[str], grammar: GrammarBitmask) -> None:
    """logits [rows, vocab] (row i: request_ids[i]) in place: tokens a constrained row's grammar does not allow
    get -inf; rows without a constraint are untouched. In C on CPU (kernels/token_bitmask.py), else torch."""
    rows = [i for i, request_id in enumerate(request_ids) if request_id in grammar.rows]
    if not rows:
        return
    bitmask = grammar.bitmask[[grammar.rows[request_ids[i]] for i in rows]]
    if token_bitmask.applies(logits):
        token_bitmask.apply_token_bitmask(logits, bitmask, rows)
    else:
        apply_with_torch(logits, bitmask, rows)


def apply_with_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """The same in torch (any device or dtype): row rows[i] of logits gets bitmask[i]."""
    vocab = logits.shape[1]
    allowed = ((bitmask.to(logits.device).unsqueeze(-1) >> _SHIFTS.to(logits.device)) & 1).view(len(rows), -1)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(allowed[:, :vocab] == 0, float("-inf"))
