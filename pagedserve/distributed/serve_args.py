"""`pagedserve serve` args out of what Serve's tools pass a builder: flag names and values, parsed as the command
line would parse them."""

from __future__ import annotations

import argparse
from typing import Union


def serve_args(args: Union[argparse.Namespace, dict, None] = None, **overrides) -> argparse.Namespace:
    """`pagedserve serve` args from a Namespace, or from flag names (dashes or underscores) and values, parsed
    as the command line would be (ValueError naming what is wrong)."""
    from pagedserve.entrypoints.cli import build_parser

    if isinstance(args, argparse.Namespace):
        return argparse.Namespace(**{**vars(args), **overrides})
    parser = build_parser()
    actions = _serve_parser(parser)._actions
    repeated = {a.dest for a in actions if isinstance(a, argparse._AppendAction)}
    negatable = {a.dest for a in actions if isinstance(a, argparse.BooleanOptionalAction)}
    argv = ["serve"]
    for key, value in {**(args or {}), **overrides}.items():
        flag = "--" + key.replace("_", "-")
        if value is True or value in ("true", "True"):
            argv.append(flag)
        elif value is False or value in ("false", "False"):
            if key.replace("-", "_") in negatable:
                argv.append("--no-" + flag[2:])
        elif value is None:
            continue
        elif isinstance(value, (list, tuple)) and key.replace("-", "_") in repeated:
            for item in value:
                argv += [flag, str(item)]
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    try:
        return parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed what is wrong
        raise ValueError(f"bad pagedserve serve arguments {argv[1:]}: {e}") from None


def _serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subcommands.choices["serve"]
