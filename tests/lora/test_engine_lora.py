"""The engine's LoRA API: add_lora / remove_lora / list_loras on the core, adapters loaded on admission,
LRU eviction that spares adapters in use, the EngineStats adapter names, and LoRA off by default."""

from __future__ import annotations

import pickle

import pytest

from conftest import assert_no_leaked_blocks
from peft_adapters import make_adapter
from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.engine.llm_engine import LLMEngine

PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("core_adapters")
    return [make_adapter(tiny_llama_dir, str(root / str(i)), i) for i in range(4)]


def make_engine(path, **kw) -> LLMEngine:
    return LLMEngine.from_kwargs(model=path, dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=128,
                                 enable_lora=True, **kw)


def lora(i: int, dirs) -> LoRARequest:
    return LoRARequest(f"adapter-{i}", i + 1, dirs[i])


def run_all(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_add_list_and_remove_an_adapter(tiny_llama_dir, adapter_dirs):
    core = make_engine(tiny_llama_dir, max_loras=2).core
    assert core.add_lora(lora(0, adapter_dirs)) is True
    assert core.add_lora(lora(0, adapter_dirs)) is False  # already loaded
    assert core.list_loras() == [lora(0, adapter_dirs)]
    assert core.remove_lora(1) is True and core.list_loras() == []
    assert core.remove_lora(1) is False


def test_a_name_or_id_of_another_loaded_adapter_is_refused(tiny_llama_dir, adapter_dirs):
    core = make_engine(tiny_llama_dir, max_loras=2).core
    core.add_lora(lora(0, adapter_dirs))
    with pytest.raises(ValueError, match="conflicts with the loaded LoRA adapter 'adapter-0'"):
        core.add_lora(LoRARequest("adapter-0", 9, adapter_dirs[1]))
    with pytest.raises(ValueError, match="conflicts with the loaded LoRA adapter 'adapter-0'"):
        core.add_lora(LoRARequest("other-name", 1, adapter_dirs[1]))


def test_a_request_loads_its_adapter_on_admission_and_removal_waits_for_it(tiny_llama_dir, adapter_dirs):
    engine = make_engine(tiny_llama_dir, max_loras=2)
    engine.add_request("r", [5, 6, 7], PARAMS, lora_request=lora(1, adapter_dirs))
    assert engine.list_loras() == [lora(1, adapter_dirs)]
    with pytest.raises(ValueError, match="'adapter-1'.*in use by queued or running requests"):
        engine.remove_lora(2)
    run_all(engine)
    assert engine.remove_lora(2) is True
    assert_no_leaked_blocks(engine)


def test_unused_adapters_beyond_max_cpu_loras_are_evicted_least_recently_used_first(tiny_llama_dir, adapter_dirs):
    engine = make_engine(tiny_llama_dir, max_loras=1, max_cpu_loras=2)
    engine.add_request("queued", [5, 6, 7], PARAMS, lora_request=lora(0, adapter_dirs))  # keeps adapter-0 in use
    for i in (1, 2, 3):
        engine.add_lora(lora(i, adapter_dirs))
    assert [r.lora_name for r in engine.list_loras()] == ["adapter-0", "adapter-3"]
    run_all(engine)
    assert_no_leaked_blocks(engine)


def test_stats_name_the_adapters_of_running_and_waiting_requests(tiny_llama_dir, adapter_dirs):
    engine = make_engine(tiny_llama_dir, max_loras=1)
    longer = SamplingParams(max_tokens=5, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], longer, lora_request=lora(0, adapter_dirs))
    engine.add_request("b", [5, 6, 7], PARAMS, lora_request=lora(1, adapter_dirs))
    engine.add_request("base", [5, 6, 7], PARAMS)
    engine.step()
    stats = engine.core.stats()
    assert stats.running_lora_adapters == ("adapter-0",) and stats.waiting_lora_adapters == ("adapter-1",)
    assert pickle.loads(pickle.dumps(stats)) == stats
    run_all(engine)
    assert engine.core.stats().running_lora_adapters == engine.core.stats().waiting_lora_adapters == ()
    assert_no_leaked_blocks(engine)


def test_requests_with_an_adapter_survive_pickling_to_the_core_process(tiny_llama_dir, adapter_dirs):
    engine = make_engine(tiny_llama_dir, max_loras=1)
    processed = engine.input_processor.process("x", [5, 6], SamplingParams(n=2), lora_request=lora(0, adapter_dirs))
    children = pickle.loads(pickle.dumps(processed.children))
    assert [c.lora_request for c in children] == [lora(0, adapter_dirs)] * 2


def test_lora_is_off_by_default_and_a_lora_request_then_names_the_flag(tiny_llama_dir, adapter_dirs):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=128)
    assert llm.engine.runner.lora_slots is None and llm.engine.scheduler.lora_slots is None
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate([5, 6, 7], PARAMS, use_tqdm=False, lora_request=lora(0, adapter_dirs))
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.engine.add_lora(lora(0, adapter_dirs))
    # A front end that leaves the check to the core (enable_lora=None) gets the same error from the core.
    unchecked = InputProcessor(None, 400, 128, frozenset()).process("y", [5, 6], lora_request=lora(0, adapter_dirs))
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.engine.core.add_requests(unchecked.children)
    assert llm.engine.list_loras() == [] and llm.engine.remove_lora(1) is False
    assert_no_leaked_blocks(llm.engine)


def test_one_lora_request_per_prompt_must_match_the_prompts(tiny_llama_dir, adapter_dirs):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=128, enable_lora=True)
    with pytest.raises(ValueError, match="got 1 lora_requests for 2 prompts"):
        llm.generate([[5, 6], [7, 8]], PARAMS, use_tqdm=False, lora_request=[lora(0, adapter_dirs)])
    with pytest.raises(ValueError, match="must be a LoRARequest"):
        llm.generate([5, 6], PARAMS, use_tqdm=False, lora_request="adapter-0")
    assert_no_leaked_blocks(llm.engine)
