"""Name the CPU a benchmark ran on: every number in docs/benchmarks.md says which of the project's CPU kinds
(AMX-BF16, AVX-512 with AVX512-BF16, AVX-512 only, AVX2 only) produced it, and for AMD which core
generation: a VM's model name is often just "AMD EPYC", and Zen 5 runs 512-bit vectors at twice Zen 4's rate
(two BF16 dot products a cycle instead of one), which changes every kernel's numbers."""

from __future__ import annotations

import os

KINDS = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX-512 + AVX512-BF16, no AMX"),
         ("avx512f", "AVX-512, no native bf16"), ("avx2", "AVX2 + FMA only, no native bf16"))


def amd_core(family: int, flags: set[str]) -> str | None:
    """The Zen generation of an AMD CPU family (/proc/cpuinfo's decimal 'cpu family'), or None if unknown."""
    if family == 0x17:
        return "Zen 1-2"
    if family == 0x19:
        return "Zen 4" if "avx512f" in flags else "Zen 3"
    if family == 0x1A:
        return "Zen 5"
    return None


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, with the Zen generation for AMD; the first processor's flags)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not line.strip():
                    break  # the first processor is enough
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model, flags = fields.get("model name", "unknown CPU"), set(fields.get("flags", "").split())
    family = fields.get("cpu family", "")
    core = amd_core(int(family), flags) if fields.get("vendor_id") == "AuthenticAMD" and family.isdigit() else None
    return (f"{model} ({core})" if core and core not in model else model), flags


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
