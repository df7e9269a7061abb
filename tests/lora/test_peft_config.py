"""Adapters whose adapter_config.json asks for something this engine does not compute are refused when they
are loaded, with a ValueError that names the adapter (name and path) and the reason."""

from __future__ import annotations

import re

import pytest

from conftest import assert_no_leaked_blocks
from peft_adapters import edit_config, make_adapter
from pagedserve import LLM, LoRARequest, SamplingParams

# name -> (make_adapter keyword arguments, config edits after saving, words the reason must contain)
REFUSED = {
    "dora": (dict(use_dora=True), {}, "DoRA"),
    "modules_to_save": (dict(modules_to_save=["lm_head"]), {}, "modules_to_save"),
    "bias_all": (dict(bias="all"), {}, "bias='all'"),
    "lora_only_bias": (dict(bias="lora_only"), {}, "bias='lora_only'"),
    "embed_tokens": (dict(modules=("embed_tokens", "q_proj")), {}, "embeddings or the LM head"),
    "lm_head": (dict(modules=("q_proj", "lm_head")), {}, "embeddings or the LM head"),
    "trainable_tokens": (dict(trainable_token_indices=[5, 6]), {}, "trainable tokens"),
    "rank_pattern": (dict(rank_pattern={"v_proj": 2}), {}, "rank_pattern"),
    "alpha_pattern": (dict(alpha_pattern={"v_proj": 2}), {}, "alpha_pattern"),
    "unknown_module": ((), {"target_modules": ["q_proj", "c_attn"]}, "'c_attn', which this model does not have"),
    "not_lora": ((), {"peft_type": "LOHA"}, "only LORA adapters"),
    "unknown_setting": ((), {"kasa_config": {"k": 1}}, "unsupported adapter_config.json setting(s): kasa_config"),
    "rank_above_limit": (dict(rank=32), {}, "rank 32 is above max_lora_rank=16"),
    "unconverted_pissa": ((), {"init_lora_weights": "pissa_niter_4"}, "changed the base model's weights"),
}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=256, enable_lora=True,
               max_loras=2, max_lora_rank=16)


@pytest.fixture(scope="module")
def refused_dirs(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("refused")
    dirs = {}
    for name, (kw, edits, _) in REFUSED.items():
        kw = dict(kw) if kw else {}
        dirs[name] = edit_config(make_adapter(tiny_llama_dir, str(root / name), 1, **kw), **edits)
    return dirs


@pytest.mark.parametrize("kind", list(REFUSED))
def test_adapter_kind_is_refused_on_add_lora_naming_it_and_why(kind, llm, refused_dirs):
    lora = LoRARequest(f"bad-{kind}", 7, refused_dirs[kind])
    expected = re.escape(f"'bad-{kind}' (id 7, path '{refused_dirs[kind]}') cannot be served: ")
    with pytest.raises(ValueError, match=expected + ".*" + re.escape(REFUSED[kind][2])):
        llm.engine.add_lora(lora)
    assert llm.engine.list_loras() == []


def test_a_request_with_a_refused_adapter_fails_alone_and_the_others_run(llm, refused_dirs):
    lora = LoRARequest("dora", 3, refused_dirs["dora"])
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="'dora'.*DoRA"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False, lora_request=lora)
    assert_no_leaked_blocks(llm.engine)
    [out] = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    assert_no_leaked_blocks(llm.engine)
