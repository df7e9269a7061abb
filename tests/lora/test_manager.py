"""LoRAManager: every load of an adapter gets a new generation; a failed load changes nothing; adapters in
use are held even past max_cpu_loras; a request may replace an unused adapter of its name, add_lora may not."""

from __future__ import annotations

import pytest
import torch

from peft_adapters import TINY, make_adapter
from pagedserve import LoRARequest
from pagedserve.config import LoRAConfig
from pagedserve.lora.manager import LoRAManager


@pytest.fixture(scope="module")
def dirs(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("manager")
    return [make_adapter(tiny_llama_dir, str(root / str(i)), i) for i in range(3)]


def manager(max_loras=1, max_cpu_loras=None) -> LoRAManager:
    return LoRAManager(LoRAConfig(enable_lora=True, max_loras=max_loras, max_cpu_loras=max_cpu_loras), TINY,
                       torch.float32)


def test_the_same_request_finds_the_same_load_and_a_reload_gets_a_new_generation(dirs):
    loras = manager()
    a = LoRARequest("a", 1, dirs[0])
    first = loras.get_or_load(a, set())
    assert loras.get_or_load(a, set()) is first
    assert loras.remove(1, set()) is first
    again = loras.get_or_load(a, set())
    assert again.generation != first.generation and loras.adapter(again.generation) is again


def test_a_failed_load_evicts_nothing(dirs, tmp_path):
    loras = manager()
    loras.get_or_load(LoRARequest("a", 1, dirs[0]), set())
    with pytest.raises(ValueError, match="'broken'"):
        loras.get_or_load(LoRARequest("broken", 2, str(tmp_path)), set())
    assert [r.lora_name for r in loras.list()] == ["a"]


def test_adapters_in_use_are_held_past_max_cpu_loras_and_unused_ones_evicted(dirs):
    loras = manager(max_loras=1, max_cpu_loras=1)
    in_use = {loras.get_or_load(LoRARequest("a", 1, dirs[0]), set()).generation}
    in_use.add(loras.get_or_load(LoRARequest("b", 2, dirs[1]), in_use).generation)
    assert [r.lora_name for r in loras.list()] == ["a", "b"]
    loras.get_or_load(LoRARequest("c", 3, dirs[2]), set())  # nothing in use now: down to the cap
    assert [r.lora_name for r in loras.list()] == ["c"]


def test_a_request_under_a_loaded_name_with_a_new_id_reloads_unless_the_old_one_is_in_use(dirs):
    loras = manager(max_loras=2)
    old = loras.get_or_load(LoRARequest("a", 1, dirs[0]), set())
    with pytest.raises(ValueError, match="conflicts with the loaded LoRA adapter 'a' .*requests use it"):
        loras.get_or_load(LoRARequest("a", 2, dirs[1]), {old.generation})
    new = loras.get_or_load(LoRARequest("a", 2, dirs[1]), set())
    assert new.generation != old.generation and loras.list() == [LoRARequest("a", 2, dirs[1])]
    with pytest.raises(ValueError, match="remove it first"):  # add_lora never replaces
        loras.add(LoRARequest("a", 3, dirs[0]), set())
