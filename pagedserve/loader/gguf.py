"""Loading GGUF checkpoints (llama.cpp's single-file format).

A GGUF file holds the model's hyper-parameters and its tokenizer as key/value metadata, and its
weights as (often block-quantized) tensors named the llama.cpp way. ``GGUFCheckpoint`` turns all
three into what the rest of the engine already understands: a Hugging Face config, HF-named float
tensors in HF layout, and a fast HF tokenizer.

    ckpt = GGUFCheckpoint("model.Q4_1.gguf")
    config = ckpt.config
    state = dict(ckpt.iter_weights(torch.bfloat16))
    tokenizer = ckpt.tokenizer()

Quantized weights are dequantized on load (the engine computes in float), with vectorised torch
code: ``gguf.quants.dequantize`` gives the same numbers (the tests check this) but is 2-3x slower.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Any, Iterator, Optional

import gguf
import numpy as np
import torch
import transformers
from gguf import GGUFValueType, Keys
from huggingface_hub.errors import StrictDataclassError
from tokenizers import AddedToken

from pagedserve.loader.gguf_file import GGUFFile
from pagedserve.loader.gguf_quants import SUPPORTED_TENSOR_TYPES, dequantize
from pagedserve.quantization import gguf_weights
from pagedserve.loader.gguf_tokenizer import (TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER_DEFINED, _byte_level_bpe,
                                             _sentencepiece_bpe)

logger = logging.getLogger(__name__)

# general.architecture -> (HF architectures entry, config class)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, type]] = {
    "llama": ("LlamaForCausalLM", transformers.LlamaConfig),
    "qwen2": ("Qwen2ForCausalLM", transformers.Qwen2Config),
}

# llama.cpp tensor names -> HF parameter names. Per-layer names live under "blk.{i}." in GGUF and
# under "model.layers.{i}." in HF; the suffix (".weight" / ".bias") is kept as is.
GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors that are not parameters of the HF model. rope_freqs holds llama3-style RoPE scaling
# factors, which the config expresses as rope_parameters instead.
NON_PARAMETER_TENSORS = {"rope_freqs.weight"}
LINEAR_KINDS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
"""The decoder layers' linear weights."""
KEPT_KINDS = LINEAR_KINDS | {"token_embd", "output"}
"""The weights --quantization gguf keeps quantized: the linears, the token embeddings and the LM head."""

# What metadata of the wrong type or value (a string where an int belongs, 0 heads) makes building the config
# raise, here or in transformers' validation of it; each becomes a ValueError naming the file.
_METADATA_ERRORS = (TypeError, ValueError, ArithmeticError, KeyError, IndexError, StrictDataclassError)


def gguf_to_hf_name(name: str) -> str:
    """HF parameter name of a llama.cpp tensor name, e.g. blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight.

    Raises ValueError for a name with no HF counterpart (rather than dropping a weight silently).
    """
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[1].isdigit() and parts[2] in LAYER_TENSOR_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_TENSOR_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GLOBAL_TENSOR_NAMES:
        return f"{GLOBAL_TENSOR_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face counterpart this loader knows")


def permute_rope_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Reorder the rows of an HF q/k projection the way llama.cpp's converter does.

    HF Llama applies RoPE with rotate_half (pairs are (j, j + head_dim/2) within a head); llama.cpp
    rotates adjacent pairs (2j, 2j+1), so its converter interleaves the two halves of every head.
    Works on weights ([out, in]) and biases ([out]).
    """
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def unpermute_rope_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of ``permute_rope_rows``: GGUF (interleaved) q/k rows back to HF (half-split) order."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# ---------------------------------------------------------------------------------------------
# The checkpoint
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _torch_threads(num_threads: Optional[int]) -> Iterator[None]:
    """Run the block with ``num_threads`` torch intra-op threads (None: unchanged), then restore."""
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        if num_threads is not None:
            torch.set_num_threads(previous)


class GGUFCheckpoint:
    """Opens a GGUF file once (GGUFFile) and exposes the model's config, weights and tokenizer."""

    def __init__(self, path: str):
        """Parse the file's metadata and tensor index (the data itself is memory-mapped, not read)."""
        self.path = str(path)
        self.config_path = self.path
        """The file the config comes from, which errors about the config name."""
        self._file = GGUFFile(self.path)
        self._tensors = {tensor.name: tensor for tensor in self._file.tensors}
        self._config: Optional[transformers.PretrainedConfig] = None

    def total_bytes(self) -> int:
        """Size of the weights' file(s): what a model built from the config must fit in."""
        return os.path.getsize(self.path)

    # -- metadata ------------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        """general.architecture, e.g. "llama"."""
        return self.metadata("general.architecture")

    @property
    def tensor_names(self) -> list[str]:
        """llama.cpp names of the file's tensors, in file order."""
        return list(self._tensors)

    def metadata(self, key: str, default: Any = None) -> Any:
        """One metadata value (see ``GGUFFile`` for the Python types), or ``default`` when absent.

        ``key`` may contain "{arch}", which is replaced by the architecture (gguf.Keys style).
        """
        if "{arch}" in key:
            key = key.format(arch=self.architecture)
        value = self._file.fields.get(key)
        return default if value is None else value

    def _require(self, key: str) -> Any:
        value = self.metadata(key)
        if value is None:
            raise ValueError(f"{self.path}: GGUF metadata {key.format(arch=self.architecture)!r} is missing")
        return value

    # -- config --------------------------------------------------------------------------------

    @property
    def config(self) -> transformers.PretrainedConfig:
        """The model's Hugging Face config (LlamaConfig or Qwen2Config), built from the metadata.

        RoPE settings are in ``config.rope_parameters`` (transformers 5 style: rope_type, rope_theta
        and, for scaled RoPE, the scaling fields).
        """
        if self._config is None:
            try:
                self._config = self._build_config()
            except _METADATA_ERRORS as e:
                if isinstance(e, ValueError) and str(e).startswith(self.path):
                    raise
                raise ValueError(f"{self.path}: its metadata does not describe a model this loader can build "
                                 f"({type(e).__name__}: {e})") from e
        return self._config

    def _build_config(self) -> transformers.PretrainedConfig:
        arch = self.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        hf_architecture, config_class = SUPPORTED_ARCHITECTURES[arch]
        hidden = int(self._require(Keys.LLM.EMBEDDING_LENGTH))
        heads = int(self._require(Keys.Attention.HEAD_COUNT))
        kv_heads = int(self.metadata(Keys.Attention.HEAD_COUNT_KV, heads))
        head_dim = self.metadata(Keys.Attention.KEY_LENGTH) or self.metadata(Keys.Rope.DIMENSION_COUNT)
        head_dim = int(head_dim) if head_dim else hidden // heads
        embedding = self._tensors.get("token_embd.weight")
        vocab_size = (
            self.metadata(Keys.LLM.VOCAB_SIZE)
            # GGUF shapes are innermost-first: token_embd is [hidden, vocab].
            or (int(embedding.shape[1]) if embedding is not None else None)
            or len(self.metadata(Keys.Tokenizer.LIST, []))
        )
        if not vocab_size:
            raise ValueError(f"{self.path}: cannot tell the vocabulary size")
        kwargs: dict[str, Any] = dict(
            architectures=[hf_architecture],
            vocab_size=int(vocab_size),
            hidden_size=hidden,
            intermediate_size=int(self._require(Keys.LLM.FEED_FORWARD_LENGTH)),
            num_hidden_layers=int(self._require(Keys.LLM.BLOCK_COUNT)),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(self.metadata(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6)),
            max_position_embeddings=int(self.metadata(Keys.LLM.CONTEXT_LENGTH, 2048)),
            rope_parameters=self._rope_parameters(head_dim),
            # llama.cpp's converter writes no output.weight when the LM head is the embedding.
            tie_word_embeddings="output.weight" not in self._tensors,
            bos_token_id=self.metadata(Keys.Tokenizer.BOS_ID),
            eos_token_id=self.metadata(Keys.Tokenizer.EOS_ID),
            pad_token_id=self.metadata(Keys.Tokenizer.PAD_ID),
        )
        if arch == "llama":
            kwargs["attention_bias"] = "blk.0.attn_q.bias" in self._tensors
        return config_class(**kwargs)

    def _rope_parameters(self, head_dim: int) -> dict[str, Any]:
        theta = float(self.metadata(Keys.Rope.FREQ_BASE, 10000.0))
        params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
        scaling = self.metadata(Keys.Rope.SCALING_TYPE)
        factor = self.metadata(Keys.Rope.SCALING_FACTOR)
        original = self.metadata(Keys.Rope.SCALING_ORIG_CTX_LEN)
        if scaling in ("linear", "yarn") and factor and factor != 1.0:
            params.update(rope_type=scaling, factor=float(factor))
            if scaling == "yarn" and original:
                params["original_max_position_embeddings"] = int(original)
        elif "rope_freqs.weight" in self._tensors:
            tensor = self._tensors["rope_freqs.weight"]
            freqs = dequantize(tensor.data, tensor.tensor_type, (-1,)).double().numpy()
            params.update(_llama3_rope_parameters(freqs, theta, head_dim, int(original or 8192)))
        return params

    # -- weights -------------------------------------------------------------------------------

    def iter_weights(self, dtype: torch.dtype, *, num_threads: Optional[int] = 1,
                     keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, tensor) for every weight, dequantized to ``dtype``, in file order.

        keep_quantized: linear-layer weights, token embeddings and LM head of a type the quantized matmul takes
        (quantization/gguf_weights.py: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) come as a QuantizedTensor instead
        (--quantization gguf).

        Tensors have HF shapes ([out_features, in_features] for linear weights) and, for llama, the
        q/k rows in HF order, so they equal the weights of the HF checkpoint the file was made from
        (up to quantization error). lm_head.weight comes only if the file has its own output.weight.

        num_threads: torch threads for dequantizing (None: leave torch's setting). Dequantizing is
        memory-bound, so one thread is about as fast as several, and it stays fast when other
        processes keep cores busy, where each parallel op would wait for a descheduled thread
        (measured on 2 shared cores: 0.3 s with one thread, 5-9 s with two).
        """
        self._check_tensors()
        config = self.config
        # Only llama's converter permutes q/k (qwen2 was converted with HF's rotate_half order kept).
        rope_heads = (
            {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
            if self.architecture == "llama"
            else {}
        )
        self._check_rope_rows(rope_heads)
        for tensor in self._file.tensors:
            if tensor.name in NON_PARAMETER_TENSORS:
                continue
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            kind = tensor.name.split(".")[-2]
            with _torch_threads(num_threads):  # not across the yield: the caller's ops keep their setting
                if keep_quantized and kind in KEPT_KINDS and tensor.tensor_type in gguf_weights.KEPT_TYPES:
                    weight = gguf_weights.from_gguf(tensor.name, tensor.data, tensor.tensor_type, shape)
                    if kind in rope_heads:
                        weight = weight.rows(unpermute_rope_rows(torch.arange(shape[0])[:, None],
                                                                 rope_heads[kind])[:, 0])
                else:
                    weight = dequantize(tensor.data, tensor.tensor_type, shape, dtype)
                    if kind in rope_heads:
                        weight = unpermute_rope_rows(weight, rope_heads[kind])
            yield gguf_to_hf_name(tensor.name), weight

    def _check_tensors(self) -> None:
        """Check every tensor first, so that a bad file fails (naming it) before any weight is loaded: an HF
        name and a type this loader dequantizes."""
        for tensor in self._file.tensors:
            if tensor.name in NON_PARAMETER_TENSORS:
                continue
            try:
                gguf_to_hf_name(tensor.name)
            except ValueError as e:
                raise ValueError(f"{self.path}: {e}") from None
            if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
                raise ValueError(
                    f"{self.path}: GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which this loader "
                    f"cannot dequantize; supported: {', '.join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))}"
                )

    def _check_rope_rows(self, rope_heads: dict[str, int]) -> None:
        """The q/k tensors to un-permute have rows that split into rope pairs for their heads."""
        for tensor in self._file.tensors:
            heads = rope_heads.get(tensor.name.split(".")[-2])
            rows = int(tensor.shape[-1]) if tensor.shape.size else 1  # dims are innermost first
            if heads is not None and rows % (2 * heads):
                raise ValueError(f"{self.path}: GGUF tensor {tensor.name!r} has {rows} rows, which do not split "
                                 f"into rope pairs for {heads} heads")

    # -- tokenizer -----------------------------------------------------------------------------

    def tokenizer(self) -> transformers.PreTrainedTokenizerFast:
        """A fast HF tokenizer built from the tokenizer.* metadata.

        Supports byte-level BPE (tokenizer.ggml.model "gpt2") and SentencePiece BPE ("llama").
        Control tokens become special tokens and user-defined ones added tokens (both matched whole
        in text); bos/eos/unk/pad, add_bos_token/add_eos_token and the chat template come from the file.
        """
        model = self.metadata(Keys.Tokenizer.MODEL)
        tokens: list[str] = self.metadata(Keys.Tokenizer.LIST) or []
        if model is None or not tokens:
            raise ValueError(f"{self.path}: the GGUF file has no tokenizer")
        types = self.metadata(Keys.Tokenizer.TOKEN_TYPE)
        types = np.full(len(tokens), TOKEN_NORMAL) if types is None else np.asarray(types)
        if model == "gpt2":
            merges = self.metadata(Keys.Tokenizer.MERGES, [])
            backend = _byte_level_bpe(tokens, merges, self.metadata(Keys.Tokenizer.PRE))
            add_bos_default = False
        elif model == "llama":
            scores = self.metadata(Keys.Tokenizer.SCORES)
            scores = np.zeros(len(tokens)) if scores is None else np.asarray(scores)
            backend = _sentencepiece_bpe(tokens, scores, types, bool(self.metadata(Keys.Tokenizer.ADD_PREFIX, True)))
            # llama.cpp adds BOS for SentencePiece vocabularies unless the file says otherwise.
            add_bos_default = True
        else:
            raise ValueError(f"{self.path}: GGUF tokenizer model {model!r} is not supported; supported: gpt2, llama")

        # Without this, "<|im_start|>" in a prompt would be split into pieces instead of being one id.
        control, user_defined = np.flatnonzero(types == TOKEN_CONTROL), np.flatnonzero(types == TOKEN_USER_DEFINED)
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user_defined])

        def token(key: str) -> Optional[str]:
            index = self.metadata(key)
            return tokens[index] if index is not None and 0 <= index < len(tokens) else None

        return transformers.PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token=token(Keys.Tokenizer.BOS_ID),
            eos_token=token(Keys.Tokenizer.EOS_ID),
            unk_token=token(Keys.Tokenizer.UNK_ID),
            pad_token=token(Keys.Tokenizer.PAD_ID),
            add_bos_token=bool(self.metadata(Keys.Tokenizer.ADD_BOS, add_bos_default)),
            add_eos_token=bool(self.metadata(Keys.Tokenizer.ADD_EOS, False)),
            chat_template=self.metadata(Keys.Tokenizer.CHAT_TEMPLATE),
            model_max_length=int(self.metadata(Keys.LLM.CONTEXT_LENGTH, 2048)),
            clean_up_tokenization_spaces=False,
        )


def _llama3_rope_parameters(factors: np.ndarray, theta: float, head_dim: int, original: int) -> dict[str, Any]:
    """Recover Llama 3 RoPE scaling parameters from llama.cpp's rope_freqs tensor.

    llama.cpp stores, per frequency, the factor its converter computed: 1 for short wavelengths,
    ``factor`` for long ones and 1 / ((1 - s) / factor + s) in between, where the ramp
    s = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor) is linear
    in 1 / wavelength. Fitting that line on the in-between frequencies gives the two factors.
    """
    factor = float(factors.max())
    params: dict[str, Any] = {
        "rope_type": "llama3",
        "factor": factor,
        "original_max_position_embeddings": original,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }
    wavelength = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64)[: len(factors)] / head_dim)
    ramp = (factors > 1 + 1e-4) & (factors < factor - 1e-4)
    if factor > 1 and ramp.sum() >= 2:
        smooth = (1 / factors[ramp] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelength[ramp], smooth, 1)
        low = -intercept * original / slope
        params.update(low_freq_factor=float(low), high_freq_factor=float(low + original / slope))
    else:
        logger.warning("rope_freqs in GGUF has no ramp to fit; assuming Llama 3 low/high freq factors 1 and 4")
    return params
