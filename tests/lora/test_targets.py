"""Where PEFT module names land: q/k/v in qkv_proj's output slices, gate/up in gate_up_proj's, in order."""

from __future__ import annotations

from peft_adapters import TINY
from pagedserve import LLM
from pagedserve.lora.targets import fused_linears, lora_shapes


def test_the_tiny_llamas_shapes_and_fused_slices(tiny_llama_dir):
    model = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 20, max_model_len=64).engine.runner.model
    assert lora_shapes(model) == TINY
    layout = {f.attribute: [(s.module, s.offset, s.size) for s in f.slices] for f in fused_linears(model)}
    assert layout == {"self_attn.qkv_proj": [("q_proj", 0, 64), ("k_proj", 64, 32), ("v_proj", 96, 32)],
                      "self_attn.o_proj": [("o_proj", 0, 64)],
                      "mlp.gate_up_proj": [("gate_proj", 0, 128), ("up_proj", 128, 128)],
                      "mlp.down_proj": [("down_proj", 0, 64)]}
