"""`pagedserve serve --config FILE`: flags from a YAML file (vLLM's --config), e.g. a Kubernetes ConfigMap.

Keys are the long flag names without the dashes (`max-model-len` or `max_model_len`); `true` turns a switch on,
a list gives a flag that takes several values (or a repeatable one) its values; quote values YAML would read as
numbers (`api-key: "0123"`). A flag given on the command line replaces the file's, repeatable ones included.
"""

from __future__ import annotations

import argparse
from typing import Any

import yaml

CONFIG_FLAG = "--config"


def expand_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with `--config FILE` replaced by the file's flags, placed first so that the command line's own
    flags override them. ValueError naming the file and the key for an unknown flag or a bad value."""
    if CONFIG_FLAG not in argv and not any(a.startswith(CONFIG_FLAG + "=") for a in argv):
        return argv
    rest, path = _take_config_flag(argv)
    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path} is not valid YAML: {e}") from None
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {path} must be a mapping of flag names to values")
    actions = {opt: a for a in parser._actions for opt in a.option_strings}  # noqa: SLF001 - argparse's own table
    given = {actions[a.split("=", 1)[0]].dest for a in rest if a.split("=", 1)[0] in actions}
    flags = [arg for key, value in values.items() for arg in _flag_args(path, str(key), value, actions)]
    # A flag the command line gives replaces the file's value(s), repeatable ones (--api-key) included.
    flags = _without(flags, given, actions)
    return rest[:1] + flags + rest[1:]


def _without(flags: list[str], dests: set[str], actions: dict) -> list[str]:
    """`flags` (as _flag_args made them: each flag followed by its values) less those of the given dests."""
    out, keep = [], True
    for arg in flags:
        action = actions.get(arg.split("=", 1)[0]) if arg.startswith("--") else None
        if action is not None:
            keep = action.dest not in dests
        if keep:
            out.append(arg)
    return out


def _take_config_flag(argv: list[str]) -> tuple[list[str], str]:
    for i, arg in enumerate(argv):
        if arg == CONFIG_FLAG:
            if i + 1 >= len(argv):
                raise ValueError("--config needs a file name")
            return argv[:i] + argv[i + 2:], argv[i + 1]
        if arg.startswith(CONFIG_FLAG + "="):
            return argv[:i] + argv[i + 1:], arg.split("=", 1)[1]
    raise AssertionError("no --config in argv")


def _flag_args(path: str, key: str, value: Any, actions: dict) -> list[str]:
    flag = "--" + key.replace("_", "-")
    action = actions.get(flag)
    if action is None or flag == CONFIG_FLAG:
        raise ValueError(f"--config {path}: {key!r} is not a flag of this command")
    switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,  # noqa: SLF001
                                 argparse.BooleanOptionalAction))
    if switch and not isinstance(value, bool):
        raise ValueError(f"--config {path}: {key} is a switch: give true or false, not {value!r}")
    if isinstance(action, argparse.BooleanOptionalAction):  # --enable-x / --no-enable-x
        return [flag if value else "--no-" + flag[2:]]
    if switch:
        return [flag] if value else []
    if isinstance(value, (dict, bool)) or value is None:
        raise ValueError(f"--config {path}: {key} takes a value or a list of values, not {value!r}")
    items = [str(v) for v in value] if isinstance(value, list) else [str(value)]
    if isinstance(action, argparse._AppendAction):  # noqa: SLF001 - a repeatable flag: once per value
        return [f"{flag}={item}" for item in items]
    if action.nargs in ("+", "*"):
        return [flag, *items]
    if len(items) > 1:
        raise ValueError(f"--config {path}: {key} takes one value, got {len(items)}")
    return [f"{flag}={items[0]}"]  # `=`: a value that starts with "-" stays a value
