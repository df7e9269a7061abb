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
from typing import Any, Callable, Iterator, Optional

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType, Keys
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

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

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


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
# Dequantization. Each function takes the raw blocks as a uint8 tensor [n_blocks, bytes_per_block]
# and returns float32 values [n_blocks, values_per_block], following ggml's reference layouts
# (ggml-quants.c, dequantize_row_*).
# ---------------------------------------------------------------------------------------------


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 stored at byte ``offset`` of every block, as float32 [n_blocks, 1]."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Low nibbles of all bytes, then high nibbles: ggml packs value j and j + n/2 in byte j."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


# The common types work in place on their one float32 buffer: fewer temporaries keep the peak
# memory and the time spent first-touching fresh pages down.


def _dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16, qs: 32 x int8; x = d * q
    return blocks[:, 2:].view(torch.int8).float().mul_(_half(blocks, 0))


def _dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16, qs: 16 bytes of 4-bit values; x = d * (q - 8)
    return _nibbles(blocks[:, 2:]).float().sub_(8.0).mul_(_half(blocks, 0))


def _dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16, m: f16, qs: 16 bytes of 4-bit values; x = d * q + m
    return _nibbles(blocks[:, 4:]).float().mul_(_half(blocks, 0)).add_(_half(blocks, 2))


def _dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # Super-block of 256 = 8 sub-blocks of 32. d, dmin: f16; scales: 12 bytes holding 8 six-bit
    # scales and 8 six-bit mins; qs: 128 bytes, each 32-byte group holds two sub-blocks (low
    # nibbles first). x = d * scale * q - dmin * min.
    n = blocks.shape[0]
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    s = blocks[:, 4:16]
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    # Sub-blocks 0-3 keep their 6 bits in bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take
    # 4 bits from bytes 8-11 and their top 2 bits from the unused top bits of bytes 0-7.
    scales = torch.cat([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], dim=1).float()
    mins = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1).float()
    q = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    out = (d * scales).unsqueeze(-1) * q - (dmin * mins).unsqueeze(-1)
    return out.reshape(n, 256)


def _dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # Super-block of 256 = 16 sub-blocks of 16. ql: 128 bytes (low 4 bits), qh: 64 bytes (high 2
    # bits), scales: 16 x int8, d: f16. x = d * scale * (q - 32). Each half of 128 values takes 64
    # ql bytes (low nibbles: values 0-63, high nibbles: 64-127) and 32 qh bytes (2-bit fields at
    # shifts 0, 2, 4, 6 for values 0-31, 32-63, 64-95, 96-127).
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, :128].reshape(n, 2, 64))
    qh = blocks[:, 128:192].reshape(n, 2, 32)
    qh = torch.cat([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, qh >> 6], dim=-1)
    q = (ql | (qh << 4)).float() - 32.0
    scales = blocks[:, 192:208].view(torch.int8).float() * _half(blocks, 208)
    return (q.reshape(n, 16, 16) * scales.unsqueeze(-1)).reshape(n, 256)


_BLOCK_DEQUANTIZERS: dict[QType, Callable[[torch.Tensor], torch.Tensor]] = {
    QType.Q8_0: _dequantize_q8_0,
    QType.Q4_0: _dequantize_q4_0,
    QType.Q4_1: _dequantize_q4_1,
    QType.Q4_K: _dequantize_q4_k,
    QType.Q6_K: _dequantize_q6_k,
}
_FLOAT_TYPES = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}
SUPPORTED_TENSOR_TYPES = frozenset(_FLOAT_TYPES) | frozenset(_BLOCK_DEQUANTIZERS)


def dequantize(
    raw: np.ndarray, qtype: QType, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode one GGUF tensor's data to a new ``dtype`` tensor of ``shape``.

    ``raw`` is the tensor's data as GGUFReader gives it (any dtype; only its bytes are read), and
    ``shape`` the logical shape in numpy order (GGUF lists dimensions innermost first, so this is
    the reverse of ReaderTensor.shape). The result never shares memory with ``raw``.
    """
    if qtype not in SUPPORTED_TENSOR_TYPES:
        raise ValueError(f"unsupported GGUF tensor type {qtype.name}")
    data = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).view(np.uint8))
    if qtype in _FLOAT_TYPES:
        # copy=True: never hand out a view of the (memory-mapped) file.
        return data.view(_FLOAT_TYPES[qtype]).reshape(shape).to(dtype, copy=True)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    values = _BLOCK_DEQUANTIZERS[qtype](data.reshape(-1, type_size))
    return values.reshape(shape).to(dtype)


# ---------------------------------------------------------------------------------------------
# Tokenizer construction
# ---------------------------------------------------------------------------------------------

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> pre-tokenizer. These mirror llama.cpp's regexes for each pre type (which
# it copied from each model's tokenizer.json), so text is split where the merges were learned.
_DIGIT_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_STYLE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral")
_QWEN2_STYLE = ("qwen2", "deepseek-r1-qwen")


def _byte_level_pre_tokenizer(pre: Optional[str]) -> pre_tokenizers.PreTokenizer:
    if pre in _DIGIT_THEN_GPT2:
        split: list = [pre_tokenizers.Digits(individual_digits=True)]
        regex = _GPT2_SPLIT
    elif pre in _LLAMA3_STYLE:
        split, regex = [], _LLAMA3_SPLIT
    elif pre in _QWEN2_STYLE:
        split, regex = [], _QWEN2_SPLIT
    else:
        if pre not in (None, "default", "gpt2", "gpt-2"):
            logger.warning("GGUF tokenizer pre-type %r is unknown; splitting text like GPT-2", pre)
        split, regex = [], _GPT2_SPLIT
    split.append(pre_tokenizers.Split(Regex(regex), behavior="isolated"))
    # use_regex=False: the Split above already did the splitting; ByteLevel only maps bytes.
    return pre_tokenizers.Sequence(split + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: Optional[str]) -> Tokenizer:
    """GPT-2 style byte-level BPE ("gpt2" in llama.cpp): tokens are already in the byte alphabet."""
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    # llama.cpp (and Llama 3's tokenizer.json) take a word that is itself a token whole.
    bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _LLAMA3_STYLE)
    tokenizer = Tokenizer(bpe)
    if pre in _QWEN2_STYLE:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _merges_from_scores(tokens: list[str], scores: np.ndarray, types: np.ndarray) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    ranked by the merged token's score (SentencePiece BPE merges the best-scoring pair first)."""
    vocab = {token: index for index, token in enumerate(tokens) if types[index] == TOKEN_NORMAL}
    ranked = []
    for token, index in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[index]), vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(tokens: list[str], scores: np.ndarray, types: np.ndarray, add_space_prefix: bool) -> Tokenizer:
    """SentencePiece BPE ("llama" in llama.cpp), with byte fallback, like HF's LlamaTokenizerFast."""
    vocab = {token: index for index, token in enumerate(tokens)}
    unk = next((tokens[i] for i in range(len(tokens)) if types[i] == TOKEN_UNKNOWN), None)
    bpe = models.BPE(
        vocab=vocab,
        merges=_merges_from_scores(tokens, scores, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    # SentencePiece writes spaces as U+2581 and (usually) prefixes the text with one.
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


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


def _field_value(field: gguf.ReaderField) -> Any:
    """A metadata value as Python: str, int/float/bool, list[str], or a numpy array for numeric arrays."""
    kind = field.types[0]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    if kind == GGUFValueType.ARRAY:
        if len(field.data) == 0:
            return []
        if field.types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if field.types[1] == GGUFValueType.ARRAY:
            raise ValueError(f"nested arrays are not supported (metadata key {field.name!r})")
        return np.concatenate([field.parts[i] for i in field.data])
    value = field.parts[field.data[0]][0]
    if kind == GGUFValueType.FLOAT32:
        # The shortest decimal that round-trips the float32 (1e-05, not 9.999999747378752e-06),
        # which is the value the original HF config had.
        return float(str(value))
    return value.item()


class GGUFCheckpoint:
    """Opens a GGUF file once (gguf.GGUFReader) and exposes the model's config, weights and tokenizer."""

    def __init__(self, path: str):
        """Parse the file's metadata and tensor index (the data itself is memory-mapped, not read)."""
        self.path = str(path)
        # mode "c" (copy-on-write) maps the file privately and writable, so torch.from_numpy can wrap
        # the data without copying it and without warning about read-only memory. Nothing writes to it.
        self._reader = gguf.GGUFReader(self.path, mode="c")
        self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}
        self._config: Optional[transformers.PretrainedConfig] = None

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
        """One metadata value (see ``_field_value`` for the Python types), or ``default`` when absent.

        ``key`` may contain "{arch}", which is replaced by the architecture (gguf.Keys style).
        """
        if "{arch}" in key:
            key = key.format(arch=self.architecture)
        field = self._reader.fields.get(key)
        return default if field is None else _field_value(field)

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
            self._config = self._build_config()
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

    def iter_weights(self, dtype: torch.dtype, *, num_threads: Optional[int] = 1) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, tensor) for every weight, dequantized to ``dtype``, in file order.

        Tensors have HF shapes ([out_features, in_features] for linear weights) and, for llama, the
        q/k rows in HF order, so they equal the weights of the HF checkpoint the file was made from
        (up to quantization error). lm_head.weight comes only if the file has its own output.weight.

        num_threads: torch threads for dequantizing (None: leave torch's setting). Dequantizing is
        memory-bound, so one thread is about as fast as several, and it stays fast when other
        processes keep cores busy, where each parallel op would wait for a descheduled thread
        (measured on 2 shared cores: 0.3 s with one thread, 5-9 s with two).
        """
        # Check everything first, so a bad file fails before any weight is loaded.
        for tensor in self._reader.tensors:
            if tensor.name in NON_PARAMETER_TENSORS:
                continue
            gguf_to_hf_name(tensor.name)
            if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
                raise ValueError(
                    f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which this loader cannot "
                    f"dequantize; supported: {', '.join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))}"
                )
        config = self.config
        # Only llama's converter permutes q/k (qwen2 was converted with HF's rotate_half order kept).
        rope_heads = (
            {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
            if self.architecture == "llama"
            else {}
        )
        for tensor in self._reader.tensors:
            if tensor.name in NON_PARAMETER_TENSORS:
                continue
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            with _torch_threads(num_threads):  # not across the yield: the caller's ops keep their setting
                weight = dequantize(tensor.data, tensor.tensor_type, shape, dtype)
                kind = tensor.name.split(".")[-2]
                if kind in rope_heads:
                    weight = unpermute_rope_rows(weight, rope_heads[kind])
            yield gguf_to_hf_name(tensor.name), weight

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
