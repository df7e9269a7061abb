"""CLI flags for every engine argument, generated from the config dataclasses (their field docs are the help)."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from pagedserve.config import (DTYPE_CHOICES, ENGINE_CONFIGS, KV_CACHE_DTYPES, QUANTIZATION_METHODS, SCHEDULING_POLICIES,
                               config_field_help)

_CONFIGS = ENGINE_CONFIGS
_CHOICES = {"dtype": DTYPE_CHOICES, "scheduling_policy": SCHEDULING_POLICIES, "kv_cache_dtype": KV_CACHE_DTYPES,
            "quantization": tuple(m for m in QUANTIZATION_METHODS if m)}
_SKIP = {("SchedulerConfig", "max_model_len")}  # set through ModelConfig's flag


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for config_cls in _CONFIGS:
        hints = typing.get_type_hints(config_cls)
        for f in dataclasses.fields(config_cls):
            if (config_cls.__name__, f.name) in _SKIP:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_text = config_field_help(config_cls, f.name).replace("%", "%%")  # argparse formats help with %
            kind = _base_type(hints[f.name])
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            else:
                extra = {"choices": _CHOICES[f.name]} if f.name in _CHOICES else {}
                group.add_argument(flag, type=kind, default=f.default, help=help_text, **extra)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine arguments out of parsed CLI args, for LLM(**kwargs) / EngineConfig.from_kwargs."""
    names = {f.name for c in _CONFIGS for f in dataclasses.fields(c)}
    return {k: v for k, v in vars(args).items() if k in names}


def _base_type(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint
