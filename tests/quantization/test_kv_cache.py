"""The 8-bit KV cache's numbers: the C write kernel quantizes exactly as the torch reference does (scales and
codes, at every ISA level), the fp8 codes round as torch's casts do, and a round trip stays within the
format's step. Names: --kv-cache-dtype values map to their storage dtypes; anything else is refused."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention.kv_layout import key_cache_shape, key_tiles_as_rows
from pagedserve.config import CacheConfig
from pagedserve.kernels import fused_ops
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.quantization import kv_cache as kv_quant

KV_DTYPES = list(kv_quant.QUANTIZED_DTYPES)


class _RopeConfig:
    rope_theta, max_position_embeddings, rope_scaling = 10000.0, 128, None
    hidden_size, num_attention_heads = 256, 4


def _cached_rows(cache: torch.Tensor, slots: torch.Tensor, is_key: bool) -> torch.Tensor:
    """A cache's bytes at `slots` as [len(slots), kv_heads, head_dim]."""
    tiles = cache.view(torch.uint8)
    if is_key:
        tiles = key_tiles_as_rows(tiles)
    num_blocks, kv_heads, block_size, head_dim = tiles.shape
    return tiles.permute(0, 2, 1, 3).reshape(-1, kv_heads, head_dim)[slots]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_write_kernel_quantizes_exactly_as_the_torch_reference(kv_dtype, model_dtype, isa):
    heads, kv_heads, head_dim, block_size, tokens = 4, 2, 64, 16, 41
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-7, 4, tokens)[:, None]  # fp8 subnormals to values far past the codes' range
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * magnitudes).to(model_dtype)
    qkv[3, heads * head_dim:] = 0  # an all-zero K and V: scale 1, codes 0
    rope = RotaryEmbedding(_RopeConfig, head_dim, 128)
    key_cache = torch.zeros(key_cache_shape(8, kv_heads, block_size, head_dim, kv_dtype), dtype=kv_dtype)
    value_cache = torch.zeros(8, kv_heads, block_size, head_dim, dtype=kv_dtype)
    scales = tuple(torch.zeros(8, kv_heads, block_size, dtype=torch.bfloat16) for _ in range(2))
    slots = torch.randperm(8 * block_size, generator=g)[:tokens]
    fused_ops.rotary_and_cache(qkv, torch.arange(tokens), rope.cos, rope.sin, key_cache, value_cache, slots,
                               heads, kv_heads, head_dim, scales)
    key = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim)
    value = qkv[:, (heads + kv_heads) * head_dim:].reshape(tokens, kv_heads, head_dim)
    for x, cache, scale, is_key in ((key, key_cache, scales[0], True), (value, value_cache, scales[1], False)):
        codes, expected_scale = kv_quant.quantize(x, kv_dtype)
        assert torch.equal(_cached_rows(cache, slots, is_key), codes.view(torch.uint8))
        assert torch.equal(scale.permute(0, 2, 1).reshape(-1, kv_heads)[slots], expected_scale)
    assert torch.equal(scales[0].permute(0, 2, 1).reshape(-1, kv_heads)[slots[3]], torch.ones(kv_heads,
                                                                                              dtype=torch.bfloat16))


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_codes_round_to_nearest_even_like_torch_casts(kv_dtype, isa):
    """Every code's value and every midpoint between neighbours (the ties) go through the C kernel."""
    values = torch.arange(256, dtype=torch.uint8).view(kv_dtype).float()
    values = values[values.isfinite()].sort().values
    candidates = torch.cat([values, (values[1:] + values[:-1]) / 2])
    qmax = kv_quant.QMAX[kv_dtype]
    head_dim = 64
    candidates = torch.cat([candidates, torch.zeros(-len(candidates) % (head_dim - 1))])  # pad the last row
    rows = candidates.view(-1, head_dim - 1)
    # one element per row at +-qmax pins the scale to 1, so each candidate is encoded as it is
    rows = torch.cat([rows, torch.full((len(rows), 1), qmax)], dim=1)
    codes, scale = kv_quant.quantize(rows, kv_dtype)
    assert torch.equal(scale.float(), torch.ones(len(rows)))
    assert torch.equal(codes.view(torch.uint8), rows.to(kv_dtype).view(torch.uint8))
    written, written_scale = _write_through_kernel(rows, kv_dtype)
    assert torch.equal(written, codes.view(torch.uint8)) and torch.equal(written_scale, scale)


def _write_through_kernel(values: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """values [n, head_dim] as V rows written by the C kernel (k = v, one kv head, no q head; position 0
    rotates by nothing), returned as the cached V bytes [n, head_dim] and their scales [n]."""
    n, head_dim = values.shape
    qkv = torch.cat([values, values], dim=1).contiguous()
    cos, sin = torch.ones(1, head_dim), torch.zeros(1, head_dim)
    blocks = -(-n // 16)
    key_cache = torch.zeros(key_cache_shape(blocks, 1, 16, head_dim, kv_dtype), dtype=kv_dtype)
    value_cache = torch.zeros(blocks, 1, 16, head_dim, dtype=kv_dtype)
    scales = tuple(torch.zeros(blocks, 1, 16, dtype=torch.bfloat16) for _ in range(2))
    fused_ops.rotary_and_cache(qkv, torch.zeros(n, dtype=torch.int64), cos, sin, key_cache, value_cache,
                               torch.arange(n), 0, 1, head_dim, scales)
    return value_cache.view(torch.uint8).reshape(-1, head_dim)[:n], scales[1].reshape(-1)[:n]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_round_trip_error_stays_within_half_a_step_of_the_largest_value(kv_dtype):
    x = torch.randn(500, 8, 64, generator=torch.Generator().manual_seed(1)) * 5
    back = kv_quant.roundtrip(x, kv_dtype)
    amax = x.abs().amax(-1, keepdim=True)
    # int8: uniform steps of amax/127; fp8: relative steps (2^-3 e4m3, 2^-2 e5m2), bf16 scale rounding on top
    bound = {torch.int8: amax / 127 * 0.51, torch.float8_e4m3fn: x.abs() / 16 + amax / 448 * 2 ** -6,
             torch.float8_e5m2: x.abs() / 8 + amax / 57344 * 2 ** -14}[kv_dtype] * 1.01
    assert ((back - x).abs() <= bound + 1e-6).all()


def test_kv_cache_dtype_names_map_to_their_storage():
    assert kv_quant.kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_quant.kv_storage_dtype("fp8", torch.float32) == torch.float8_e4m3fn  # vLLM's meaning of fp8
    assert kv_quant.kv_storage_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    assert kv_quant.kv_storage_dtype("int8", torch.float32) == torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_quant.kv_storage_dtype("fp4", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, int8"):
        CacheConfig(kv_cache_dtype="float16")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_a_nan_in_k_or_v_stays_nan_in_the_cache(kv_dtype, isa):
    """A model that blew up must not be hidden: the row's scale (and fp8 codes) come back NaN."""
    values = torch.randn(2, 64)
    values[1, 5] = float("nan")
    codes, scales = _write_through_kernel(values, kv_dtype)
    back = kv_quant.dequantize(codes.view(kv_dtype), scales)
    assert not back[0].isnan().any() and back[1].isnan().all()
