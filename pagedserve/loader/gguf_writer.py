"""Writing a Hugging Face Llama / Qwen2 model to a GGUF file, laid out as llama.cpp's converter does.

Its main use is tests: a tiny random model written with ``write_gguf`` exercises the GGUF loader
(and the whole engine) without a real model file. It also works as a simple converter for small
models. The file gets llama.cpp tensor names, q/k rows permuted for llama, the architecture
metadata, 1-D tensors in F32 and 2-D ones in the requested type, and, optionally, a byte-level
BPE tokenizer with ChatML special tokens (see ``byte_tokenizer_vocab``).

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(...))
    write_gguf(model, "tiny.gguf", quant="Q8_0")
"""

from __future__ import annotations

import math
from typing import Optional

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from pagedserve.loader.gguf import GLOBAL_TENSOR_NAMES, LAYER_TENSOR_NAMES, permute_rope_rows
from pagedserve.loader.gguf_tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNUSED

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Special tokens of the byte tokenizer, at ids 0, 1, 2 as in SmolLM2 (bos = <|im_start|>, eos = <|im_end|>).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}  # HF model_type -> general.architecture
_HF_TO_GGUF = {hf: g for g, hf in GLOBAL_TENSOR_NAMES.items()} | {hf: g for g, hf in LAYER_TENSOR_NAMES.items()}


def hf_to_gguf_name(name: str) -> str:
    """llama.cpp name of an HF parameter, e.g. model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight."""
    stem, suffix = name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, module = stem.split(".", 3)
        return f"blk.{layer}.{_HF_TO_GGUF[module]}.{suffix}"
    return f"{_HF_TO_GGUF[stem]}.{suffix}"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet byte-level BPE tokens are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer_vocab(vocab_size: int) -> tuple[list[str], list[int]]:
    """(tokens, token types) of a byte-level BPE vocabulary without merges: the three ChatML special
    tokens, the 256 bytes, then unused filler tokens up to ``vocab_size``. Any text encodes (one
    token per byte) and decodes back exactly."""
    base = len(SPECIAL_TOKENS) + 256
    if vocab_size < base:
        raise ValueError(f"a byte tokenizer needs vocab_size >= {base}, got {vocab_size}")
    tokens = SPECIAL_TOKENS + list(bytes_to_unicode().values()) + [f"<|unused_{i}|>" for i in range(vocab_size - base)]
    types = [TOKEN_CONTROL] * len(SPECIAL_TOKENS) + [TOKEN_NORMAL] * 256 + [TOKEN_UNUSED] * (vocab_size - base)
    return tokens, types


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for Llama 3 RoPE scaling: the factor each frequency is divided by."""
    theta, factor = rope["rope_theta"], rope["factor"]
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    original = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _encode(array: np.ndarray, qtype: QType) -> np.ndarray:
    if qtype == QType.F32:
        return array.astype(np.float32)
    if qtype == QType.F16:
        return array.astype(np.float16)
    if qtype in K_QUANTIZERS:  # gguf.quants only dequantizes these
        if array.shape[-1] % 256:
            raise ValueError(f"{qtype.name} needs rows of a multiple of 256 values, not {array.shape[-1]}")
        return K_QUANTIZERS[qtype](array.astype(np.float32))
    return gguf.quants.quantize(array.astype(np.float32), qtype)


def quantize_q6_k(array: np.ndarray) -> np.ndarray:
    """float32 [..., K] (K % 256 == 0) -> Q6_K blocks (uint8 [..., K / 256 * 210]), ggml's layout (see
    gguf_quants.q6_k_codes): per 16 values a scale that maps the largest magnitude to -32, the 16 scales as int8
    times one f16 d. A plain rounding, not llama.cpp's error-minimizing search: a valid file for tests and
    benchmarks, a little less accurate than llama.cpp's."""
    blocks = array.reshape(-1, 16, 16).astype(np.float32)
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]
    sub_scales = peak / -32.0
    d = (np.abs(sub_scales).max(-1) / 127.0).astype(np.float16)
    safe_d = np.where(d == 0, 1, d).astype(np.float32)
    scales = np.clip(np.round(sub_scales / safe_d[:, None]), -128, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * scales.astype(np.float32)
    q = np.round(blocks / np.where(step == 0, 1, step)[..., None]) + 32
    q = np.where(step[..., None] == 0, 32, np.clip(q, 0, 63)).astype(np.uint8).reshape(-1, 2, 128)
    ql = (q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)
    top = q >> 4
    qh = top[:, :, :32] | (top[:, :, 32:64] << 2) | (top[:, :, 64:96] << 4) | (top[:, :, 96:] << 6)
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), scales.view(np.uint8),
                          d[:, None].view(np.uint8)], axis=1)
    return out.reshape(*array.shape[:-1], array.shape[-1] // 256 * 210)


def quantize_q4_k(array: np.ndarray) -> np.ndarray:
    """float32 [..., K] (K % 256 == 0) -> Q4_K blocks (uint8 [..., K / 256 * 144]), ggml's layout (see
    gguf_quants.q4_k_groups): per 32 values a scale and a min (value = d * scale * q - dmin * min), both 6-bit
    multiples of the super-block's f16 d and dmin. A plain rounding, as quantize_q6_k."""
    groups = array.reshape(-1, 8, 32).astype(np.float32)
    low = np.minimum(groups.min(-1), 0)
    spans = (groups.max(-1) - low) / 15.0
    d = (spans.max(-1) / 63.0).astype(np.float16)
    dmin = (-low.min(-1) / 63.0).astype(np.float16)
    sc = np.clip(np.round(spans / np.where(d == 0, 1, d).astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-low / np.where(dmin == 0, 1, dmin).astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.round((groups + offset[..., None]) / np.where(step == 0, 1, step)[..., None])
    q = np.where(step[..., None] == 0, 0, np.clip(q, 0, 15)).astype(np.uint8).reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    packed_scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                                    (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)
    out = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), packed_scales, qs], axis=1)
    return out.reshape(*array.shape[:-1], array.shape[-1] // 256 * 144)


K_QUANTIZERS = {QType.Q6_K: quantize_q6_k, QType.Q4_K: quantize_q4_k}


def write_gguf(
    model: torch.nn.Module,
    path: str,
    quant: str = "F32",
    *,
    tokenizer: bool = True,
    chat_template: Optional[str] = CHATML_TEMPLATE,
    alignment: Optional[int] = None,
    quant_by_kind: Optional[dict[str, str]] = None,
) -> None:
    """Write an HF ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` (any dtype) to ``path`` as GGUF.

    quant: the ggml type of the 2-D weights ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", ... any
    type gguf.quants can quantize); 1-D tensors (norms, biases) stay F32, as llama.cpp keeps them.
    tokenizer: also write a byte-level BPE tokenizer (``byte_tokenizer_vocab``; needs vocab_size >= 259)
    with ``chat_template``.
    alignment: of the tensor data, written as general.alignment (None: llama.cpp's default, 32, not written).
    quant_by_kind: types for some tensor kinds instead of ``quant`` (``{"attn_v": "Q6_K", "ffn_down": "Q6_K"}``
    with ``quant="Q4_K"`` is a Q4_K_M-like file); Q4_K and Q6_K are encoded here (quantize_q4_k / _q6_k).
    """
    config = model.config
    arch = _ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise ValueError(f"cannot write model_type {config.model_type!r} to GGUF; supported: {sorted(_ARCHITECTURES)}")
    qtype = QType[quant]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")

    writer = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_name(getattr(config, "_name_or_path", "") or f"tiny-{arch}")
    file_type = getattr(gguf.LlamaFileType, "ALL_F32" if qtype == QType.F32 else f"MOSTLY_{quant}", None)
    if file_type is not None:
        writer.add_file_type(int(file_type))
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if head_dim != config.hidden_size // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if rope_type in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_type))
        writer.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope_type == "llama3":
        # llama.cpp stores Llama 3 scaling as a tensor of per-frequency factors, not as metadata.
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))

    if tokenizer:
        tokens, types = byte_tokenizer_vocab(config.vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_pad_token_id(2)
        writer.add_add_bos_token(False)
        if chat_template:
            writer.add_chat_template(chat_template)

    tied = getattr(config, "tie_word_embeddings", False)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue  # llama.cpp writes no output.weight for tied embeddings
        gguf_name = hf_to_gguf_name(name)
        tensor = tensor.detach().float()
        # llama.cpp's llama converter interleaves q/k rows (and biases) for its RoPE (see permute_rope_rows).
        kind = gguf_name.split(".")[-2]
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            tensor = permute_rope_rows(tensor, heads if kind == "attn_q" else kv_heads)
        array = tensor.numpy()
        if array.ndim == 1:
            writer.add_tensor(gguf_name, array.astype(np.float32))
        else:
            tensor_type = QType[(quant_by_kind or {}).get(kind, quant)]
            writer.add_tensor(gguf_name, _encode(array, tensor_type), raw_dtype=tensor_type)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
