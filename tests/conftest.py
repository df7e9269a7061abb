"""Shared fixtures: tiny random-weight models built on the fly (no downloads), and a leak check."""

from __future__ import annotations

import os
import weakref

import pytest
import torch

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the KV cache in fixed-size blocks.",
    "Continuous batching re-forms the batch at every step!",
    "Ünïcödé text, 日本語のテキスト, emoji 🙂🚀 and numbers 12345.",
    "Hello, world. Hello again, world? Bonjour le monde; hola mundo.",
]


def build_tokenizer(path: str):
    """A small byte-level BPE tokenizer trained on a few sentences, saved as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING_TEXT * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                          "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    fast.save_pretrained(path)
    return fast


def build_tiny_model(path: str, arch: str = "llama", seed: int = 0, tie: bool = False, **config) -> str:
    """A 2-layer random-weight Llama or Qwen2 with the small tokenizer, saved as safetensors; `config` overrides
    the config's fields (e.g. hidden_size and num_attention_heads for another head_dim)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(path)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.1, tie_word_embeddings=tie, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, torch_dtype="float32")
    common.update(config)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=10000.0))
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen2")), "qwen2", seed=1)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from pagedserve.loader.model_loader import default_model_path as find

    try:
        return find()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(params=["avx512_bf16", "avx512", "avx2", "generic"])
def isa(request, monkeypatch):
    """Runs a kernel test once per ISA level of kernels/build.py that this CPU can run (the others skip,
    naming the level), with PAGEDSERVE_CPU_ISA forced and the loaded libraries reset before and after."""
    from pagedserve.kernels import build

    level = request.param
    assert level in build.ISA_LEVELS
    if build.ISA_LEVELS.index(level) > build.ISA_LEVELS.index(build.native_isa()):
        pytest.skip(f"CPU has no {level}: that path is not tested here")
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", level)
    build.reset()
    yield level
    build.reset()  # the next load reads the environment that monkeypatch restores


def assert_c_decode_loop_matches_python_layers(llm, prompts, params) -> None:
    """The one-call C decode loop (kernels/decode_layers.py) gives exactly the Python layers' tokens and
    cumulative logprobs for these prompts (the prefix cache is reset between the two runs)."""
    model = llm.engine.runner.model
    fast = llm.generate(prompts, params, use_tqdm=False)
    saved, model._decode_layers = model._decode_layers, None
    try:
        llm.reset_prefix_cache()
        slow = llm.generate(prompts, params, use_tqdm=False)
    finally:
        model._decode_layers = saved
    for a, b in zip(fast, slow):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob


def assert_no_leaked_blocks(engine) -> None:
    """Every KV block is back in the pool and nothing is left queued (an LLMEngine, or an AsyncLLM whose core
    runs in its own process: then the core is asked for a fresh snapshot, when it is still running)."""
    from pagedserve.engine.async_llm import AsyncLLM

    if isinstance(engine, AsyncLLM):
        assert not engine.output_processor.requests and not engine._targets
        if engine.is_alive():
            stats = engine.core_stats()
            assert stats.num_running == stats.num_waiting == stats.num_requests_holding_blocks == 0
            assert stats.num_free_blocks == stats.num_blocks > 0
        return
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    assert not engine.kv_cache_manager.req_to_blocks
    assert not engine.output_processor.requests


_live_engines: "weakref.WeakSet" = None


@pytest.fixture(autouse=True)
def every_kv_block_is_free_after_each_test():
    """Block accounting, checked after every test on every engine still alive: all blocks back in the pool."""
    yield
    for engine in list(_live_engines):
        assert_no_leaked_blocks(engine)


def pytest_configure(config):
    global _live_engines
    from pagedserve.engine.llm_engine import LLMEngine

    _live_engines = weakref.WeakSet()
    original_init = LLMEngine.__init__

    def tracking_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        _live_engines.add(self)

    LLMEngine.__init__ = tracking_init
    # Tests must not depend on the machine's thread count for determinism of what they compare.
    torch.set_num_threads(min(2, os.cpu_count() or 1))
