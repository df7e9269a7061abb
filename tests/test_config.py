"""Engine configs: LoRAConfig's defaults and checks (vLLM's names), and the routing of flat engine arguments."""

from __future__ import annotations

import pytest

from pagedserve.config import EngineConfig, LoRAConfig


def test_lora_defaults_are_vllms():
    config = LoRAConfig()
    assert (config.enable_lora, config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (False, 1, 16, None)
    assert config.cpu_capacity == 1 and LoRAConfig(max_loras=3).cpu_capacity == 3
    assert LoRAConfig(max_loras=2, max_cpu_loras=5).cpu_capacity == 5


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_loras=0), "max_loras must be >= 1"),
    (dict(max_lora_rank=0), "max_lora_rank must be >= 1"),
    (dict(max_loras=4, max_cpu_loras=2), r"max_cpu_loras \(2\) must be >= max_loras \(4\)"),
])
def test_invalid_lora_settings_raise_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**kwargs)


def test_lora_engine_arguments_reach_the_lora_config():
    config = EngineConfig.from_kwargs(enable_lora=True, max_loras=4, max_lora_rank=64, max_num_seqs=8)
    assert config.lora_config == LoRAConfig(enable_lora=True, max_loras=4, max_lora_rank=64)
    assert config.scheduler_config.max_num_seqs == 8
