"""The fused C kernels give bit-identical results to the torch ops they replace, where the layers use them,
at every ISA level this CPU can run (the `isa` fixture, tests/conftest.py)."""

import pytest
import torch

from pagedserve.attention.kv_layout import key_tiles_as_rows, key_cache_shape
from pagedserve.kernels import fused_ops
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import apply_rotary



@pytest.fixture
def kernel(isa):
    """The ISA level, with the library built for it."""
    if not fused_ops.fuses_rotary(torch.zeros(1)):
        pytest.skip("no C compiler")
    return isa


def torch_norm(dim: int, dtype: torch.dtype, seed: int = 0) -> RMSNorm:
    norm = RMSNorm(dim, 1e-5)
    norm.weight.data = torch.randn(dim, generator=torch.Generator().manual_seed(seed))
    return norm.to(dtype)


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 rows x 576 takes the multi-threaded path
def test_rms_norm_with_residual_equals_torch_bitwise_in_bfloat16(kernel, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 4).bfloat16()
    residual = torch.randn(rows, 576, generator=g).bfloat16()
    norm = torch_norm(576, torch.bfloat16)
    expected_residual = residual + x
    expected = norm._norm(expected_residual)
    out = fused_ops.rms_norm(x, norm.weight, norm.eps, residual)
    assert torch.equal(residual, expected_residual)  # updated in place
    assert torch.equal(out, expected)
    assert torch.equal(fused_ops.rms_norm(x, norm.weight, norm.eps), norm._norm(x))


def test_layer_norm_takes_the_fused_path_only_where_it_is_exact(kernel):
    x = torch.randn(4, 64)
    assert fused_ops.fuses_norm(x.bfloat16()) and not fused_ops.fuses_norm(x)
    norm = torch_norm(64, torch.float32)
    out, residual = norm(x, torch.ones(4, 64))
    assert torch.equal(residual, x + 1) and torch.equal(out, norm._norm(x + 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_cache_rotates_in_place_and_stores_kv_at_the_slots(kernel, dtype):
    heads, kv_heads, head_dim, tokens, block_size = 9, 3, 64, 50, 16
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 900, (tokens,), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(1000).float(), inv_freq)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    c, s = cos[positions].to(dtype).unsqueeze(1), sin[positions].to(dtype).unsqueeze(1)
    expected_q = apply_rotary(q.reshape(tokens, heads, head_dim), c, s)
    expected_k = apply_rotary(k.reshape(tokens, kv_heads, head_dim), c, s)
    expected_v = v.reshape(tokens, kv_heads, head_dim).clone()
    key_cache = torch.full(key_cache_shape(40, kv_heads, block_size, head_dim, dtype), float("nan"), dtype=dtype)
    value_cache = torch.full((40, kv_heads, block_size, head_dim), float("nan"), dtype=dtype)  # NaN: never written
    slots = torch.randperm(40 * block_size, generator=g)[:tokens]
    slots[0] = -1  # a padding token: rotated but not stored

    fused_ops.rotary_and_cache(qkv, positions, cos, sin, key_cache, value_cache, slots, heads, kv_heads, head_dim)

    assert torch.equal(qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim), expected_q)
    assert torch.equal(qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim),
                       expected_k)
    by_slot = lambda cache: cache.permute(0, 2, 1, 3).reshape(-1, kv_heads, head_dim)
    assert torch.equal(by_slot(key_tiles_as_rows(key_cache))[slots[1:]], expected_k[1:])
    assert torch.equal(by_slot(value_cache)[slots[1:]], expected_v[1:])
    assert (~key_cache.isnan()).sum() == (~value_cache.isnan()).sum() == (tokens - 1) * kv_heads * head_dim


@pytest.mark.parametrize("rows", [1, 16, 300])  # 300 x 1536 takes the multi-threaded path
def test_swiglu_matches_torch_silu_times_up_in_bfloat16(kernel, rows):
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=g) * 6).bfloat16()  # large |x|: both branches of the sigmoid
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])
    expected = torch.nn.functional.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    out = fused_ops.swiglu(gate_up)
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    # Its exp is not torch's: a result may be one bf16 rounding step off, and almost all are identical.
    assert torch.allclose(out.float(), expected.float(), rtol=2 ** -7, atol=1e-6)
    assert (out == expected).float().mean() > 0.99
    assert fused_ops.swiglu(gate_up[:1]).equal(out[:1])  # a row's result does not depend on the batch


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 63), (7, 64), (5, 1000), (256, 4099)])
def test_argmax_equals_torch_max_indices_with_ties_signed_zeros_infinities_and_nans(kernel, rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=g).mul(3).round().bfloat16()  # rounded: many ties
    special = [0.0, -0.0, float("inf"), float("-inf"), float("nan")]
    picks = torch.randint(0, rows * vocab, (rows * vocab // 7,), generator=g)
    logits.view(-1)[picks] = torch.tensor(special, dtype=torch.bfloat16)[torch.arange(len(picks)) % len(special)]
    logits[0] = -0.0  # -0 and +0 tie: the first wins
    logits[0, -1] = 0.0
    if rows > 2:
        logits[1] = float("-inf")
        logits[2, :] = float("nan")
    assert torch.equal(fused_ops.argmax(logits), logits.max(dim=-1).indices)


def test_argmax_declines_what_it_does_not_compute(kernel):
    assert fused_ops.argmax(torch.zeros(2, 8)) is None  # float32: torch's
    assert fused_ops.argmax(torch.zeros(2, 0, dtype=torch.bfloat16)) is None
