"""Tensor operations on logits used by the sampler: bias, bans, penalties, and the top-k/top-p/min-p cut.

All functions take batched tensors; none loops over rows in Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class PenaltyTensors:
    """Penalties, batch-wide ([B], neutral value in rows without one: 0, 0, 1; None when no row uses it),
    and the token ids they act on as flat (batch row, token id) pairs."""

    presence: Optional[torch.Tensor]
    frequency: Optional[torch.Tensor]
    repetition: Optional[torch.Tensor]
    output_rows: torch.Tensor  # [N] batch row of each output token of the penalised rows
    output_tokens: torch.Tensor  # [N]
    prompt_rows: Optional[torch.Tensor]  # [M] as above, prompt tokens of rows with a repetition penalty
    prompt_tokens: Optional[torch.Tensor]  # [M]


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor) -> None:
    """In place: ``logits[rows[i], tokens[i]] += values[i]``."""
    logits.index_put_((rows, tokens), values, accumulate=True)


def ban_tokens(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """In place: ``logits[rows[i], tokens[i]] = -inf`` (min_tokens keeps eos and stop tokens out)."""
    logits.index_put_((rows, tokens), torch.tensor(float("-inf"), device=logits.device))


def apply_penalties(logits: torch.Tensor, pen: PenaltyTensors) -> None:
    """In place, in vLLM's order:

    * repetition (HF/vLLM): for tokens seen in the prompt or output, positive logits are divided by the
      penalty and the others multiplied by it;
    * frequency (OpenAI): ``logit -= frequency * count_in_output``;
    * presence (OpenAI): ``logit -= presence * (count_in_output > 0)``.

    Only the (row, token) entries that occur are read and written: the cost is in the number of tokens,
    not in the vocabulary size.
    """
    vocab = logits.shape[1]
    flat = logits.view(-1)
    out_keys = pen.output_rows * vocab + pen.output_tokens
    if pen.repetition is not None:
        keys = out_keys
        if pen.prompt_tokens is not None:
            keys = torch.cat([keys, pen.prompt_rows * vocab + pen.prompt_tokens])
        seen = torch.unique(keys)
        factor = pen.repetition[seen // vocab]
        vals = flat[seen]
        flat[seen] = torch.where(vals > 0, vals / factor, vals * factor)
    if pen.frequency is not None or pen.presence is not None:
        keys, counts = torch.unique(out_keys, return_counts=True)
        vals = flat[keys]
        if pen.frequency is not None:
            vals = vals - pen.frequency[keys // vocab] * counts
        if pen.presence is not None:
            vals = vals - pen.presence[keys // vocab]
        flat[keys] = vals


def cut_threshold(
    vals: torch.Tensor,
    top_k: Optional[torch.Tensor],
    top_p: Optional[torch.Tensor],
    min_p: Optional[torch.Tensor],
    vocab_size: Optional[int] = None,
    row_mass: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where min_p, then top_k, then top_p cut each row (vLLM semantics).

    ``vals`` [N, K] holds each row's (temperature-scaled) logits sorted in descending order: the whole row,
    or only its K largest of ``vocab_size``. ``top_k`` [N] long (0: off), ``top_p`` [N] (1: off), ``min_p``
    [N] (0: off); None when no row uses it. Meaning: drop tokens with probability below min_p * the largest
    probability; of the rest keep the top_k most likely; of those, renormalised, keep the smallest
    most-likely-first set whose probability reaches top_p.

    Returns ``thr`` [N]: keep exactly the tokens whose logit is >= thr (tokens tied with the last kept one
    are kept too, as vLLM's top-k does), and ``resolved`` [N]: whether the K values decide the row (always
    True for whole rows). Deciding a top_p row from a window needs, unless top_k or min_p end its
    candidates inside the window, ``row_mass`` [N]: sum over the whole row of exp(logit - max) for the
    tokens that pass min_p.
    """
    num_rows, k_win = vals.shape
    dev = vals.device
    complete = vocab_size is None or vocab_size <= k_win
    n_keep = torch.full((num_rows,), k_win, dtype=torch.long, device=dev)
    if top_k is not None:
        n_keep = torch.where(top_k > 0, top_k.clamp(max=k_win), n_keep)
    if min_p is not None:
        cutoff = vals[:, :1] + torch.log(min_p.to(vals.dtype)).unsqueeze(1)
        n_keep = torch.minimum(n_keep, (vals >= cutoff).sum(-1))
    agree = None
    if top_p is not None:
        pos = torch.arange(k_win, device=dev)
        w = (vals - vals[:, :1]).exp_().masked_fill_(pos >= n_keep.unsqueeze(1), 0.0)
        cum = w.cumsum(-1, dtype=torch.float64)
        p = top_p.to(torch.float64).unsqueeze(1)
        mass = cum[:, -1:]
        if not complete:
            # Candidates go on past the window unless min_p or a top_k <= K ended them in it; their mass is
            # then row_mass (without it, such rows are left undecided).
            open_end = n_keep >= k_win
            if top_k is not None:
                open_end &= (top_k == 0) | (top_k > k_win)
            if row_mass is not None:
                mass = torch.where(open_end.unsqueeze(1), row_mass.to(torch.float64).unsqueeze(1), mass)
            else:
                agree = ~open_end | (top_p >= 1)
        # Token j is kept while the mass of the likelier tokens, cum[j-1], is below p * mass (j=0 always).
        n_p = 1 + (cum[:, :-1] < p * mass).sum(-1)
        n_keep = torch.where(top_p < 1, torch.minimum(n_keep, n_p), n_keep)
    thr = vals.gather(1, (n_keep - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    if complete:
        return thr, torch.ones(num_rows, dtype=torch.bool, device=dev)
    # Decided in the window when all it keeps is in it (nothing outside ties the last kept value) and the
    # window holds the top_k candidates.
    resolved = thr > vals[:, -1]
    if top_k is not None:
        resolved &= top_k <= k_win
    if agree is not None:
        resolved &= agree
    return thr, resolved


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: Optional[torch.Tensor] = None,
    top_p: Optional[torch.Tensor] = None,
    min_p: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reference form of the cut (sorts whole rows): a copy of ``logits`` with the dropped tokens at -inf."""
    vals = logits.sort(dim=-1, descending=True).values
    thr, _ = cut_threshold(vals, top_k, top_p, min_p)
    return logits.masked_fill(logits < thr.unsqueeze(1), float("-inf"))
