"""Applying a step's grammar bitmask to the logits of its constrained rows (the model runner's one call)."""

from __future__ import annotations

import torch

from pagedserve.structured_output.manager import GrammarBitmask


def apply_grammar_bitmask(logits: torch.Tensor, request_ids: list[str], grammar: GrammarBitmask) -> None:
    """logits [rows, vocab] (row i: request_ids[i]) in place: tokens a constrained row's grammar does not allow
    get -inf; rows without a constraint are untouched."""
    import xgrammar as xgr

    rows = [i for i, request_id in enumerate(request_ids) if request_id in grammar.rows]
    if not rows:
        return
    aligned = torch.full((logits.shape[0], grammar.bitmask.shape[1]), -1, dtype=torch.int32)
    aligned[rows] = grammar.bitmask[[grammar.rows[request_ids[i]] for i in rows]]
    xgr.apply_token_bitmask_inplace(logits, aligned.to(logits.device), indices=rows)
