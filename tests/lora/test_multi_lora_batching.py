"""Several adapters in one batch: every request gets what it gets alone, whatever shares its step; with fewer
slots than adapters in flight, adapters take turns in the slots and everything still finishes, correctly."""

from __future__ import annotations

import pytest

from conftest import assert_no_leaked_blocks
from peft_adapters import ALL_MODULES, make_adapter, random_prompt
from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.kernels import decode_layers

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
SHAPES = [dict(modules=("q_proj", "v_proj"), rank=4), dict(modules=ALL_MODULES, rank=8),
          dict(modules=("o_proj", "down_proj"), rank=16), dict(modules=ALL_MODULES, rank=2, use_rslora=True),
          dict(modules=("k_proj", "gate_proj", "up_proj"), rank=6), dict(modules=ALL_MODULES, rank=12)]


@pytest.fixture(scope="module")
def loras(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch_adapters")
    return [LoRARequest(f"adapter-{i}", i + 1, make_adapter(tiny_llama_dir, str(root / str(i)), 100 + i, **kw))
            for i, kw in enumerate(SHAPES)]


def make_llm(path, **kw):
    return LLM(path, dtype=kw.pop("dtype", "float32"), kv_cache_memory_bytes=1 << 23, max_model_len=256,
               enable_lora=True, max_lora_rank=16, **kw)


def run_alone(llm, prompts, loras):
    return [llm.generate({"prompt_token_ids": p}, PARAMS, use_tqdm=False, lora_request=lora)[0]
            for p, lora in zip(prompts, loras)]


def assert_same_outputs(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batch_of_four_adapters_and_the_base_model_gives_each_request_its_output_alone(tiny_llama_dir, loras,
                                                                                          dtype):
    # In bf16, steps of at most 32 rows keep every matmul on the small-batch kernel, whose rows do not depend
    # on the rest of the batch (torch's bf16 BLAS, used for more rows, rounds differently with other shapes).
    budget = {"max_num_batched_tokens": 32} if dtype == "bfloat16" else {}
    llm = make_llm(tiny_llama_dir, max_loras=4, dtype=dtype, **budget)
    # Prompts of several lengths so that a step mixes decodes and prefills of different adapters.
    per_request = [None] + loras[:4]
    prompts = [random_prompt(seed, 3 + 7 * seed) for seed in range(10)]
    assigned = [per_request[i % len(per_request)] for i in range(len(prompts))]
    alone = run_alone(llm, prompts, assigned)
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False,
                            lora_request=assigned)
    assert_same_outputs(together, alone)
    # Each adapter changes its request's tokens (no silent base-model fallback inside a mixed batch).
    base = run_alone(llm, prompts, [None] * len(prompts))
    for lora, mixed, plain in zip(assigned, together, base):
        if lora is not None:
            assert mixed.outputs[0].token_ids != plain.outputs[0].token_ids
    assert_no_leaked_blocks(llm.engine)


def test_six_adapters_through_two_slots_all_finish_with_their_own_outputs(tiny_llama_dir, loras):
    llm = make_llm(tiny_llama_dir, max_loras=2, max_num_seqs=8)
    prompts = [random_prompt(seed, 6 + seed) for seed in range(14)]
    assigned = [None, None] + [loras[i % 6] for i in range(12)]
    alone = run_alone(llm, prompts, assigned)
    engine = llm.engine
    copies, distinct_per_step = [], []
    activate, schedule = engine.runner.lora_slots.activate, engine.scheduler.schedule

    def counting_activate(assignment, adapter_of):
        copies.append(activate(assignment, adapter_of))
        return copies[-1]

    def recording_schedule():
        out = schedule()
        distinct_per_step.append({r.lora_generation for r in engine.scheduler.running} - {None})
        return out

    engine.runner.lora_slots.activate = counting_activate
    engine.scheduler.schedule = recording_schedule
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False,
                            lora_request=assigned)
    assert_same_outputs(together, alone)
    assert max(len(d) for d in distinct_per_step) == 2  # never more adapters running than slots
    assert sum(copies) >= 6  # each adapter was copied into a slot at least once: they took turns
    assert_no_leaked_blocks(engine)


def test_decode_steps_with_lora_rows_take_the_c_decode_layers_bit_for_bit_as_the_python_layers(
        tiny_llama_dir, loras, monkeypatch, isa):
    # `isa`: once per kernel level this CPU runs (each level has its own small-batch kernel and packing).
    llm = make_llm(tiny_llama_dir, max_loras=4, dtype="bfloat16")
    model = llm.engine.runner.model
    if model._decode_layers is None:
        pytest.skip(f"no C decode-layers path at {isa} (needs the bf16 small-batch kernels)")
    calls = []
    original = decode_layers.DecodeLayers.forward
    monkeypatch.setattr(decode_layers.DecodeLayers, "forward", lambda self, hidden, *a: calls.append(
        (hidden.shape[0], a[-1] is not None)) or original(self, hidden, *a))
    prompts = [{"prompt_token_ids": random_prompt(seed, 5 + seed)} for seed in range(10)]
    assigned = [([None] + loras[:4])[i % 5] for i in range(10)]
    fast = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=assigned)
    assert model._decode_layers.takes_lora()
    assert (10, True) in calls  # decode steps of the mixed batch ran in C, with the LoRA mapping
    saved, model._decode_layers = model._decode_layers, None
    try:
        slow = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=assigned)
    finally:
        model._decode_layers = saved
    for a, b in zip(fast, slow, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob
    base = llm.generate(prompts, PARAMS, use_tqdm=False)
    for lora, mixed, plain in zip(assigned, fast, base):
        if lora is not None:  # the deltas were applied in C: no silent base-model output
            assert mixed.outputs[0].token_ids != plain.outputs[0].token_ids
    assert_no_leaked_blocks(llm.engine)
