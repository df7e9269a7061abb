"""Reading an adapter's tensors: scaling folded into B in the engine dtype; missing files, missing or unknown
tensors, wrong shapes and layers the model does not have are refused, naming the adapter and the problem."""

from __future__ import annotations

import math
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from peft_adapters import TINY, edit_config, make_adapter
from pagedserve import LoRARequest
from pagedserve.lora.adapter import WEIGHTS_FILE, load_adapter
KEY = "base_model.model.model.layers.{}.self_attn.{}.lora_{}.weight"


@pytest.fixture(scope="module")
def good_dir(tiny_llama_dir, tmp_path_factory):
    return make_adapter(tiny_llama_dir, str(tmp_path_factory.mktemp("good") / "a"), 3, rank=4, alpha=12)


@pytest.fixture
def copy_of(good_dir, tmp_path):
    def copy() -> str:
        return shutil.copytree(good_dir, str(tmp_path / "copy"))
    return copy


def load(path: str, dtype=torch.float32, max_rank: int = 16):
    return load_adapter(LoRARequest("tested", 5, path), TINY, max_rank, dtype, generation=1)


def rewrite_tensors(path: str, change) -> None:
    file = os.path.join(path, WEIGHTS_FILE)
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)


def refused(path: str, reason: str):
    """pytest.raises for the adapter named "tested" at `path`, with `reason` in the message."""
    return pytest.raises(ValueError, match=re.escape(f"'tested' (id 5, path '{path}') cannot be served: ")
                         + ".*" + re.escape(reason))


def test_scaling_is_folded_into_b_in_the_engine_dtype(good_dir):
    adapter = load(good_dir, torch.bfloat16)
    raw = load_file(os.path.join(good_dir, WEIGHTS_FILE))
    a, b = adapter.weights[(1, "v_proj")]
    assert adapter.rank == 4 and adapter.scaling == 3.0 and a.dtype == b.dtype == torch.bfloat16
    assert torch.equal(a, raw[KEY.format(1, "v_proj", "A")].to(torch.bfloat16))
    assert torch.equal(b, (raw[KEY.format(1, "v_proj", "B")] * 3.0).to(torch.bfloat16))
    assert set(adapter.weights) == {(layer, m) for layer in (0, 1) for m in ("q_proj", "v_proj")}


def test_rslora_scales_by_alpha_over_the_square_root_of_the_rank(copy_of):
    path = edit_config(copy_of(), use_rslora=True)
    assert load(path).scaling == pytest.approx(12 / math.sqrt(4))


def test_missing_folder_or_config_is_refused(tmp_path):
    with refused(str(tmp_path / "nowhere"), "adapter_config.json not found"):
        load(str(tmp_path / "nowhere"))
    with refused(str(tmp_path), "adapter_config.json not found"):
        load(str(tmp_path))


def test_missing_safetensors_is_refused_and_a_bin_file_is_not_read(copy_of):
    path = copy_of()
    os.rename(os.path.join(path, WEIGHTS_FILE), os.path.join(path, "adapter_model.bin"))
    with refused(path, "adapter_model.safetensors not found") as info:
        load(path)
    assert "only safetensors are read" in str(info.value)


def test_a_module_with_a_but_no_b_is_refused(copy_of):
    path = copy_of()
    rewrite_tensors(path, lambda t: t.pop(KEY.format(0, "q_proj", "B")))
    with refused(path, "layers.0.q_proj has no lora_B weight"):
        load(path)


def test_an_unknown_tensor_is_refused_by_name(copy_of):
    path = copy_of()
    rewrite_tensors(path, lambda t: t.update({"base_model.model.model.layers.0.self_attn.q_proj.lora_C.weight":
                                              torch.zeros(4, 64)}))
    with refused(path, "unknown tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_C.weight'"):
        load(path)


def test_shapes_of_another_base_model_are_refused(copy_of):
    path = copy_of()
    rewrite_tensors(path, lambda t: t.update({KEY.format(0, "q_proj", "A"): torch.zeros(4, 96)}))
    with refused(path, "layers.0.q_proj: lora_A is (4, 96)"):
        load(path)


def test_a_layer_the_model_does_not_have_is_refused(copy_of):
    path = copy_of()
    rewrite_tensors(path, lambda t: t.update({KEY.format(2, "q_proj", "A"): torch.zeros(4, 64),
                                              KEY.format(2, "q_proj", "B"): torch.zeros(64, 4)}))
    with refused(path, "is for layer 2; the model has 2 layers"):
        load(path)


def test_a_tensor_for_a_module_target_modules_does_not_list_is_refused(copy_of):
    path = copy_of()
    rewrite_tensors(path, lambda t: t.update({KEY.format(0, "k_proj", "A"): torch.zeros(4, 64),
                                              KEY.format(0, "k_proj", "B"): torch.zeros(32, 4)}))
    with refused(path, "is for k_proj, which target_modules does not list"):
        load(path)


def test_a_rank_above_max_lora_rank_is_refused(good_dir):
    with refused(good_dir, "rank 4 is above max_lora_rank=2 (raise --max-lora-rank)"):
        load(good_dir, max_rank=2)
