"""`pagedserve serve --config FILE`: flags from YAML (vLLM's --config), the command line winning."""

from __future__ import annotations

import pytest

from pagedserve.entrypoints.cli import _serve_parser, build_parser, main
from pagedserve.entrypoints.config_file import expand_config_file


def parse(argv):
    return build_parser().parse_args(expand_config_file(_serve_parser(), argv))


def test_a_config_file_sets_values_switches_lists_and_repeatable_flags(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("port: 9000\nmax_model_len: 512\nlog-format: json\ndisable-log-requests: true\n"
                    "log-prompts: false\nserved-model-name: [a, b]\napi-key: [k1, k2]\n"
                    "enable-prefix-caching: false\nenable-lora: true\n")
    args = parse(["serve", "--config", str(path)])
    assert (args.port, args.max_model_len, args.log_format) == (9000, 512, "json")
    assert args.disable_log_requests and not args.log_prompts
    assert args.served_model_name == ["a", "b"] and args.api_key == ["k1", "k2"]
    assert args.enable_prefix_caching is False and args.enable_lora is True


def test_the_command_line_wins_over_the_file(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("port: 9000\nhost: 0.0.0.0\n")
    args = parse(["serve", "--port", "7000", f"--config={path}"])
    assert (args.port, args.host) == (7000, "0.0.0.0")


@pytest.mark.parametrize("text, message", [
    ("no-such-flag: 1\n", "'no-such-flag' is not a flag"),
    ("disable-log-requests: yes please\n", "is a switch"),
    ("port: [1, 2]\n", "takes one value"),
    ("port: {a: 1}\n", "takes a value"),
    ("- port\n", "must be a mapping"),
    ("port: [\n", "not valid YAML"),
])
def test_a_bad_config_file_is_a_value_error_naming_the_file_and_key(tmp_path, text, message):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        parse(["serve", "--config", str(path)])
    assert str(path) in str(e.value)


def test_serve_with_a_missing_config_file_exits_2_naming_it(tmp_path, capsys):
    assert main(["serve", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_a_repeatable_flag_on_the_command_line_replaces_the_files_values(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("api-key: [file-key]\nserved-model-name: [a, b]\nport: 9000\n")
    args = parse(["serve", "--config", str(path), "--api-key", "cli-key", "--served-model-name", "c"])
    assert args.api_key == ["cli-key"] and args.served_model_name == ["c"] and args.port == 9000


def test_a_value_that_starts_with_a_dash_stays_a_value(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("api-key: [-secret]\nhost: -weird\n")
    args = parse(["serve", "--config", str(path)])
    assert args.api_key == ["-secret"] and args.host == "-weird"


@pytest.mark.parametrize("argv", [["--conf", "X"], ["--config", "X", "--config", "X"]])
def test_an_abbreviated_or_repeated_config_flag_is_an_error_not_ignored(tmp_path, capsys, argv):
    path = tmp_path / "config.yaml"
    path.write_text("port: 9000\n")
    assert main(["serve", *[str(path) if a == "X" else a for a in argv]]) == 2
    assert "--config once" in capsys.readouterr().err
