"""A path a request names is confined to the allowed directories: `..`, symlinks out (the folder itself or a
file in it) and any path without an allowed directory are refused, naming the field."""

from __future__ import annotations

import asyncio
import os

import pytest

from pagedserve.entrypoints.openai.allowed_paths import PathNotAllowedError, confined, resolved_dirs
from pagedserve.entrypoints.openai.errors import OpenAIError
from pagedserve.entrypoints.openai.lora_modules import LoRAModules


@pytest.fixture
def tree(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "good").mkdir(parents=True)
    (allowed / "good" / "adapter_config.json").write_text("{}")
    (outside / "secret").mkdir(parents=True)
    (outside / "secret" / "adapter_config.json").write_text("{}")
    return allowed, outside, resolved_dirs([str(allowed)], "--allowed-lora-dirs")


def test_a_folder_inside_an_allowed_directory_is_allowed_resolved(tree):
    allowed, _, roots = tree
    assert confined(str(allowed / "good"), roots, "lora_path") == os.path.realpath(allowed / "good")
    assert confined(str(allowed / "good" / ".." / "good"), roots, "lora_path").endswith("good")


def test_dot_dot_out_of_the_directory_is_refused(tree):
    allowed, _, roots = tree
    with pytest.raises(PathNotAllowedError, match="not inside a directory this server allows"):
        confined(str(allowed / ".." / "outside" / "secret"), roots, "lora_path")


def test_a_symlinked_folder_pointing_out_is_refused(tree):
    allowed, outside, roots = tree
    os.symlink(outside / "secret", allowed / "link")
    with pytest.raises(PathNotAllowedError):
        confined(str(allowed / "link"), roots, "lora_path")


def test_a_file_in_the_folder_that_links_out_is_refused(tree):
    allowed, outside, roots = tree
    (outside / "weights").write_bytes(b"secret")
    os.symlink(outside / "weights", allowed / "good" / "adapter_model.safetensors")
    with pytest.raises(PathNotAllowedError, match="adapter_model.safetensors links outside"):
        confined(str(allowed / "good"), roots, "lora_path")


def test_a_prefix_of_the_directory_name_is_not_inside_it(tmp_path):
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora-evil").mkdir()
    roots = resolved_dirs([str(tmp_path / "lora")], "--allowed-lora-dirs")
    with pytest.raises(PathNotAllowedError):
        confined(str(tmp_path / "lora-evil"), roots, "lora_path")


def test_an_allowed_directory_that_does_not_exist_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--allowed-lora-dirs: .* is not a directory"):
        resolved_dirs([str(tmp_path / "missing")], "--allowed-lora-dirs")


class _NoEngine:
    max_model_len = 256

    def add_lora(self, lora_request) -> None:
        raise AssertionError("a refused path reached the engine")


@pytest.mark.parametrize("allowed", [False, True])
def test_the_load_route_refuses_before_the_engine_sees_the_path(tree, allowed):
    allowed_dir, outside, roots = tree
    modules = LoRAModules(_NoEngine(), ["base"], enabled=True, allowed_dirs=roots if allowed else ())
    with pytest.raises(OpenAIError) as e:
        asyncio.run(modules.load("x", str(outside / "secret")))
    assert e.value.status == 400 and e.value.param == "lora_path"
    assert ("not inside" if allowed else "--allowed-lora-dirs") in e.value.message
