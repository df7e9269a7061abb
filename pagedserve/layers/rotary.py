"""Rotary position embeddings (rotate-half / NeoX layout, as in HF checkpoints)."""

from __future__ import annotations

import torch


def rope_parameters(hf_config) -> dict:
    """rope_theta and rope scaling from either transformers' v5 `rope_parameters` or the older fields."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return params


def inverse_frequencies(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim / 2] and the attention scaling factor, for any rope type transformers knows."""
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    with torch.device("cpu"):  # for real even while the model is built on the meta device: a bad factor is then
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")  # a TypeError, not a meta copy error
    return inv_freq.float(), float(scaling)


class RotaryEmbedding:
    """Holds a cos/sin table for every position up to max_positions (float32, computed once)."""

    def __init__(self, hf_config, head_dim: int, max_positions: int) -> None:
        inv_freq, scaling = inverse_frequencies(hf_config, head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64, device="cpu").float(), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos() * scaling
        self.sin = emb.sin() * scaling

    def to(self, device: torch.device) -> "RotaryEmbedding":
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the given positions, shaped [num_tokens, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, head_dim] rotated by rotate-half."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
