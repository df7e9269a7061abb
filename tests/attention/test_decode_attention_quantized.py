"""Decode attention over an 8-bit cache: the C kernel gives bit for bit what it gives over a float32 cache
holding the dequantized values (at every ISA level and shape path), stays close to the unquantized cache,
and the torch reference path (which gathers and dequantizes the context) agrees with it."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention import cpu_decode
from pagedserve.attention.metadata import DecodeBatch
from pagedserve.attention.torch_paged import decode_attention_torch
from pagedserve.quantization import kv_cache as kv_quant

KV_DTYPES = list(kv_quant.QUANTIZED_DTYPES)
SHAPES = [(64, 16), (128, 32), (64, 8), (32, 16)]  # (head_dim, block_size): AVX-512, AVX2-only, plain C paths


def _caches(head_dim: int, block_size: int, kv_dtype: torch.dtype, seed: int = 0):
    """Random K/V blocks [blocks, kv_heads, block_size, head_dim], quantized; returns the 8-bit caches, their
    scales, and float32 caches of the dequantized values (both in the kernel's layouts)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(24, 2, block_size, head_dim, generator=g) * 3
    v = torch.randn(24, 2, block_size, head_dim, generator=g)
    (k_codes, k_scale), (v_codes, v_scale) = kv_quant.quantize(k, kv_dtype), kv_quant.quantize(v, kv_dtype)
    as_key_tiles = lambda rows: rows.transpose(-1, -2).contiguous().unsqueeze(-1)  # pack 1: [.., D, bs, 1]
    key_codes = as_key_tiles(k_codes.view(torch.uint8)).view(kv_dtype)
    dequantized = (as_key_tiles(kv_quant.dequantize(k_codes, k_scale)), kv_quant.dequantize(v_codes, v_scale))
    return (key_codes, v_codes), (k_scale, v_scale), dequantized, (as_key_tiles(k), v)


def _case(kv_dtype: torch.dtype, seed: int, query_dtype: torch.dtype = torch.float32, head_dim: int = 64,
          block_size: int = 16):
    """(8-bit caches, their scales, dequantized caches, original caches, block tables, context lens, query)."""
    caches, scales, dequantized, original = _caches(head_dim, block_size, kv_dtype)
    tables, lens = _batch(block_size)
    query = torch.randn(5, 6, head_dim, generator=torch.Generator().manual_seed(seed)).to(query_dtype)
    return caches, scales, dequantized, original, tables, lens, query


def _batch(block_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tables = torch.stack([torch.randperm(24, generator=g)[:10] for _ in range(5)])
    lens = torch.tensor([1, block_size, block_size + 3, 5 * block_size - 1, 10 * block_size])
    return tables, lens


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim,block_size", SHAPES)
def test_kernel_equals_the_float32_kernel_over_dequantized_values_bit_for_bit(kv_dtype, query_dtype, head_dim,
                                                                           block_size, isa):
    caches, scales, dequantized, _, tables, lens, query = _case(kv_dtype, 2, query_dtype, head_dim, block_size)
    out = cpu_decode.decode_attention(query, *caches, tables, lens, scales)
    reference = cpu_decode.decode_attention(query.float(), *dequantized, tables, lens).to(query_dtype)
    assert torch.equal(out, reference)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_kernel_stays_close_to_the_unquantized_cache(kv_dtype, isa):
    caches, scales, _, original, tables, lens, query = _case(kv_dtype, 3)
    out = cpu_decode.decode_attention(query, *caches, tables, lens, scales)
    exact = cpu_decode.decode_attention(query, *original, tables, lens)
    # Outputs are ~unit-scale mixtures of V rows; K at 3x scale makes the scores sharp. Measured maxima here:
    # int8 0.032, e4m3 0.113, e5m2 0.197 (2^-8, 2^-4, 2^-3 relative steps); bounds at about 1.5x those.
    tolerance = {torch.int8: 0.05, torch.float8_e4m3fn: 0.17, torch.float8_e5m2: 0.3}[kv_dtype]
    error = (out - exact).abs()
    assert error.max() < tolerance and error.mean() < tolerance / 5  # mean measured: 0.005, 0.018, 0.036


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_reference_path_agrees_with_the_kernel(kv_dtype, query_dtype):
    caches, scales, _, _, tables, lens, query = _case(kv_dtype, 4, query_dtype)
    torch_out = decode_attention_torch(query, *caches, DecodeBatch(tables, lens, 2, 16), scales)
    kernel_out = cpu_decode.decode_attention(query, *caches, tables, lens, scales)
    # both compute in float32 over the dequantized values; bf16 outputs may round to neighbouring values
    tolerance = 1e-5 if query_dtype == torch.float32 else 0.016
    assert (torch_out.float() - kernel_out.float()).abs().max() < tolerance


def test_an_8bit_cache_without_its_scales_is_a_clear_error():
    caches, scales, _, _ = _caches(64, 16, torch.int8)
    tables, lens = _batch(16)
    query = torch.randn(5, 6, 64)
    with pytest.raises(ValueError, match="torch.int8 cache needs scales"):
        cpu_decode.decode_attention(query, *caches, tables, lens)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_stale_slots_past_the_context_do_not_change_the_output(kv_dtype, isa):
    """Codes and scales of slots no sequence has reached yet (here NaN scales and 0xff codes) are never read."""
    caches, scales, _, _, tables, lens, query = _case(kv_dtype, 5)
    clean = cpu_decode.decode_attention(query, *caches, tables, lens, scales)
    dirty_caches = tuple(c.clone() for c in caches)
    dirty_scales = tuple(s.clone() for s in scales)
    for b, n in enumerate(lens.tolist()):  # every slot of the sequence's blocks at or past its length
        for position in range(n, tables.shape[1] * 16):
            block, offset = tables[b, position // 16], position % 16
            if any(((tables[o] == block).nonzero().flatten() * 16 + offset < lens[o]).any()
                   for o in range(len(lens)) if o != b):
                continue  # another sequence reads this slot
            for s in dirty_scales:
                s[block, :, offset] = float("nan")
            dirty_caches[0].view(torch.uint8)[block, :, :, offset] = 0xFF
            dirty_caches[1].view(torch.uint8)[block, :, offset] = 0xFF
    assert torch.equal(cpu_decode.decode_attention(query, *dirty_caches, tables, lens, dirty_scales), clean)
