"""Per-step sampling tensors for the Sampler, built from the batch's SamplingParams.

Everything a step does not use is left out (None), so the sampler skips its work entirely.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Optional, Sequence

import torch

from pagedserve.layers.logits_processors import PenaltyTensors
from pagedserve.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Per-step tensors for the sampler; build() skips every part that no row uses.

    "Random rows" are the rows that are not greedy; R is their number and the per-random-row tensors
    (temperature, top_k, top_p, min_p) are indexed by position among them.
    """

    num_rows: int
    all_greedy: bool
    all_random: bool
    greedy_idx: Optional[torch.Tensor]  # [B-R] rows taking argmax; None unless the batch is mixed
    random_idx: Optional[torch.Tensor]  # [R] rows that sample; None unless the batch is mixed
    temperature: Optional[torch.Tensor]  # [R]; None when every random row has temperature 1
    top_k: Optional[torch.Tensor]  # [R] long, 0 = off; None when unused
    top_p: Optional[torch.Tensor]  # [R], 1 = off; None when unused
    min_p: Optional[torch.Tensor]  # [R], 0 = off; None when unused
    cut_pos: Optional[torch.Tensor]  # positions among random rows using top_k or top_p; None if none
    plain_pos: Optional[torch.Tensor]  # the other random rows; None if none
    generators: list[tuple[int, torch.Generator]]  # (position among random rows, its generator)
    logit_bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # rows, tokens, values
    banned: Optional[tuple[torch.Tensor, torch.Tensor]]  # rows, tokens masked to -inf (min_tokens)
    penalties: Optional[PenaltyTensors]
    max_num_logprobs: Optional[int]  # K; None when no row wants logprobs
    logprob_idx: Optional[torch.Tensor] = None  # rows that want logprobs; None when all do (or none)
    max_top_k: int = 0  # largest top_k when every top_k/top_p row has a top_k (a smaller first window)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[Optional[torch.Generator]],
        stop_token_ids_for_min_tokens: Sequence[set[int]],
        device: torch.device,
    ) -> "SamplingMetadata":
        """One entry per row of the logits. ``generators[i]`` must live on ``device``. The sets in
        ``stop_token_ids_for_min_tokens`` are masked as given (empty once min_tokens is reached).
        ``prompt_token_ids`` entries may be lists or 1-D tensors (a runner may cache the latter)."""
        num = len(params)

        def t(data, dtype):
            return torch.tensor(data, dtype=dtype, device=device)

        greedy = [i for i, p in enumerate(params) if p.greedy]
        rand = [i for i, p in enumerate(params) if not p.greedy]
        mixed = bool(greedy) and bool(rand)
        rp = [params[i] for i in rand]

        temperature = top_k = top_p = min_p = cut_pos = plain_pos = None
        max_top_k = 0
        gens: list[tuple[int, torch.Generator]] = []
        if rp:
            if any(p.temperature != 1.0 for p in rp):
                temperature = t([p.temperature for p in rp], torch.float32)
            if any(p.top_k > 0 for p in rp):
                top_k = t([p.top_k for p in rp], torch.long)
            if any(p.top_p < 1.0 for p in rp):
                top_p = t([p.top_p for p in rp], torch.float32)
            if any(p.min_p > 0.0 for p in rp):
                min_p = t([p.min_p for p in rp], torch.float32)
            cut = [j for j, p in enumerate(rp) if p.top_k > 0 or p.top_p < 1.0]
            max_top_k = max(rp[j].top_k for j in cut) if cut and all(rp[j].top_k > 0 for j in cut) else 0
            if cut:
                cut_pos = t(cut, torch.long)
                if len(cut) < len(rp):
                    plain_pos = t(sorted(set(range(len(rp))) - set(cut)), torch.long)
            else:
                plain_pos = t(list(range(len(rp))), torch.long)
            gens = [(j, generators[i]) for j, i in enumerate(rand) if generators[i] is not None]

        bias_rows, bias_toks, bias_vals = [], [], []
        for i, p in enumerate(params):
            if p.logit_bias:
                bias_rows += [i] * len(p.logit_bias)
                bias_toks += list(p.logit_bias.keys())
                bias_vals += list(p.logit_bias.values())
        logit_bias = None
        if bias_rows:
            logit_bias = (t(bias_rows, torch.long), t(bias_toks, torch.long), t(bias_vals, torch.float32))

        ban_rows, ban_toks = [], []
        for i, toks in enumerate(stop_token_ids_for_min_tokens):
            if toks:
                ban_rows += [i] * len(toks)
                ban_toks += list(toks)
        banned = (t(ban_rows, torch.long), t(ban_toks, torch.long)) if ban_rows else None

        wants = [p.logprobs for p in params if p.logprobs is not None]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        return cls(
            num_rows=num,
            all_greedy=not rand,
            all_random=not greedy,
            greedy_idx=t(greedy, torch.long) if mixed else None,
            random_idx=t(rand, torch.long) if mixed else None,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            cut_pos=cut_pos,
            plain_pos=plain_pos,
            generators=gens,
            logit_bias=logit_bias,
            banned=banned,
            penalties=_build_penalties(params, prompt_token_ids, output_token_ids, device),
            max_num_logprobs=max(wants) if wants else None,
            logprob_idx=t(logprob_rows, torch.long) if 0 < len(logprob_rows) < num else None,
            max_top_k=max_top_k,
        )


def _build_penalties(params, prompt_token_ids, output_token_ids, device) -> Optional[PenaltyTensors]:
    rows = [i for i, p in enumerate(params)
            if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0]
    if not rows:
        return None

    def per_row(name, neutral):
        if all(getattr(params[i], name) == neutral for i in rows):
            return None
        return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device)

    def flatten(lists, which):
        """(batch row, token id) pairs of lists[i] for i in which, in one tensor each."""
        seqs = [lists[i] for i in which]
        lengths = torch.tensor([len(x) for x in seqs], dtype=torch.long)
        if any(isinstance(x, torch.Tensor) for x in seqs):
            flat = torch.cat([torch.as_tensor(x, dtype=torch.long).reshape(-1).cpu() for x in seqs])
        else:
            flat = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long)
        batch_rows = torch.repeat_interleave(torch.tensor(which, dtype=torch.long), lengths)
        return batch_rows.to(device), flat.to(device)

    output_rows, output_tokens = flatten(output_token_ids, rows)
    prompt_rows = prompt_tokens = None
    repetition_rows = [i for i in rows if params[i].repetition_penalty != 1.0]
    if repetition_rows:
        prompt_rows, prompt_tokens = flatten(prompt_token_ids, repetition_rows)
    return PenaltyTensors(
        presence=per_row("presence_penalty", 0.0),
        frequency=per_row("frequency_penalty", 0.0),
        repetition=per_row("repetition_penalty", 1.0),
        output_rows=output_rows,
        output_tokens=output_tokens,
        prompt_rows=prompt_rows,
        prompt_tokens=prompt_tokens,
    )
