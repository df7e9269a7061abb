"""Name the CPU a benchmark ran on: every number in docs/benchmarks.md says which of the project's CPU kinds
(AMX-BF16, AVX-512 with AVX512-BF16, AVX-512 only, AVX2 only) produced it."""

from __future__ import annotations

import os

KINDS = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX-512 + AVX512-BF16, no AMX"),
         ("avx512f", "AVX-512, no native bf16"), ("avx2", "AVX2 + FMA only, no native bf16"))


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags


def cpu_kind_flag() -> str:
    """The best of amx_bf16 / avx512_bf16 / avx512f / avx2 this CPU has ('other' for none)."""
    _, flags = _cpuinfo()
    return next((flag for flag, _ in KINDS if flag in flags), "other")


def cpu_kind() -> str:
    """E.g. 'AMD EPYC, 2 cores: AVX-512 + AVX512-BF16, no AMX (avx512_bf16)'."""
    model, _ = _cpuinfo()
    flag = cpu_kind_flag()
    label = dict(KINDS).get(flag, "no AVX2")
    return f"{model}, {os.cpu_count()} cores: {label} ({flag})"
