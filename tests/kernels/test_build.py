"""The ISA level is chosen at run time from the CPU flags, can be forced lower, and keys the built libraries."""

import platform
import shutil
import subprocess

import pytest
import torch

from pagedserve.attention import cpu_decode
from pagedserve.kernels import build, fused_ops, skinny_gemm

AVX2_CPU = "fpu sse4_2 avx avx2 fma f16c bmi1 bmi2".split()  # e.g. an AMD EPYC before Zen 4
ZEN4_CPU = AVX2_CPU + "avx512f avx512bw avx512vl avx512cd avx512dq avx512_bf16".split()
EXTRA_FLAGS = {"skinny_gemm": (), "decode_attention": cpu_decode._EXTRA_FLAGS, "fused_ops": fused_ops._EXTRA_FLAGS,
               "quant_gemm": ()}
"""Each library's flags as its wrapper builds it (so that the tests load the very libraries the layers use)."""


@pytest.fixture
def fresh(monkeypatch):
    """No PAGEDSERVE_CPU_ISA; build's per-process state reset before and after."""
    monkeypatch.delenv("PAGEDSERVE_CPU_ISA", raising=False)
    build.reset()
    yield monkeypatch
    build.reset()


def implied_by_cpuinfo() -> str:
    """The level the brief's rule gives for this CPU's /proc/cpuinfo flags."""
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags:
        return "avx512_bf16"
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "generic"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="not an x86-64 CPU")
def test_cpu_isa_is_what_proc_cpuinfo_implies(fresh):
    assert build.cpu_isa() == build.native_isa() == implied_by_cpuinfo()


def test_detect_isa_per_cpu_kind():
    assert build.detect_isa(ZEN4_CPU) == "avx512_bf16"  # also Intel with AMX-BF16, which has AVX512-BF16
    assert build.detect_isa([f for f in ZEN4_CPU if f != "avx512_bf16"]) == "avx512"
    assert build.detect_isa(AVX2_CPU) == "avx2"
    assert build.detect_isa([f for f in AVX2_CPU if f != "fma"]) == "generic"
    assert build.detect_isa("fpu sse4_2 avx512f avx512bw avx512vl".split()) == "generic"  # no AVX2 under it


def test_override_picks_any_level_at_or_below_the_cpu():
    for level in build.ISA_LEVELS:
        assert build.choose_isa(level, ZEN4_CPU) == level
    assert build.choose_isa(None, AVX2_CPU) == build.choose_isa("", AVX2_CPU) == "avx2"


def test_override_rejects_an_unknown_name(fresh):
    fresh.setenv("PAGEDSERVE_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="allowed: generic, avx2, avx512, avx512_bf16"):
        build.cpu_isa()
    with pytest.raises(ValueError, match="avx9"):
        build.load_library("fused_ops")


def test_override_rejects_a_level_above_the_cpu(fresh):
    with pytest.raises(ValueError, match="cannot run it .*allowed here: generic, avx2$"):
        build.choose_isa("avx512", AVX2_CPU)
    above = build.ISA_LEVELS[build.ISA_LEVELS.index(build.native_isa()) + 1:]
    for level in above:  # none on an AVX512-BF16 machine
        fresh.setenv("PAGEDSERVE_CPU_ISA", level)
        build.reset()
        with pytest.raises(ValueError, match="cannot run it"):
            build.cpu_isa()


def test_vnni_flags_are_added_where_the_cpu_has_vnni_and_the_level_has_its_registers():
    cascade_lake = [f for f in ZEN4_CPU if f != "avx512_bf16"] + ["avx512_vnni"]
    alder_lake = AVX2_CPU + ["avx_vnni"]
    assert build.optional_flags("avx512", cascade_lake) == ["-mavx512vnni"]
    assert build.optional_flags("avx2", cascade_lake) == []  # 512-bit VNNI needs the AVX-512 level
    assert build.optional_flags("avx2", alder_lake) == build.optional_flags("avx512", alder_lake) == ["-mavxvnni"]
    assert build.optional_flags("avx2", AVX2_CPU) == build.optional_flags("generic", alder_lake) == []
    assert build.optional_flags("avx512_bf16", ZEN4_CPU + ["avx512_vnni", "avx_vnni"]) == []  # -march=native


@pytest.mark.skipif(platform.machine() != "x86_64", reason="not an x86-64 CPU")
def test_a_compiler_that_refuses_an_optional_flag_still_builds_the_levels_own_path(fresh, tmp_path, caplog):
    """gcc before 11 knows no -mavxvnni: the kernel is then built without it, not lost."""
    if shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    fresh.setattr(build, "_OPTIONAL", (("generic", "fpu", "-mno-such-option-pagedserve-test"),))
    fresh.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    fresh.setenv("PAGEDSERVE_CPU_ISA", "generic")  # every x86 CPU runs it, and it takes that optional flag
    build.reset()
    library = build.load_library("fused_ops", EXTRA_FLAGS["fused_ops"])
    assert library is not None and "building without" in caplog.text


def test_each_level_builds_its_own_library(isa):
    library = build.load_library("fused_ops", EXTRA_FLAGS["fused_ops"])
    if library is None:
        pytest.skip("no C compiler")
    assert build.cpu_isa() == isa and f"fused_ops-{isa}-" in library._name


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump")
@pytest.mark.parametrize("level", ["avx2", "generic"])
@pytest.mark.parametrize("name", ["skinny_gemm", "decode_attention", "fused_ops", "quant_gemm"])
def test_lower_levels_hold_no_wider_instructions(fresh, level, name):
    """What an AVX2 CPU would fault on: no AVX-512 register (zmm, mask) in the avx2 build, no AVX in generic."""
    if build.ISA_LEVELS.index(level) > build.ISA_LEVELS.index(build.native_isa()):
        pytest.skip(f"CPU has no {level}: that path is not tested here")
    fresh.setenv("PAGEDSERVE_CPU_ISA", level)
    build.reset()
    library = build.load_library(name, EXTRA_FLAGS[name])
    if library is None:
        pytest.skip("no C compiler")
    code = subprocess.run(["objdump", "-d", library._name], capture_output=True, text=True, check=True).stdout
    assert "vfmadd" in code or level == "generic" or name == "fused_ops"  # the AVX2 + FMA paths are built
    assert "zmm" not in code and "%k1" not in code
    if level == "generic":
        assert "ymm" not in code


def test_kernels_off_turns_every_kernel_off(fresh):
    fresh.setenv("PAGEDSERVE_CPU_KERNEL", "0")
    fresh.setenv("PAGEDSERVE_CPU_ISA", "avx9")  # not even read when the kernels are off
    assert build.load_library("fused_ops") is None and cpu_decode.load() is None
    assert not fused_ops.fuses_rotary(torch.zeros(1))
    assert skinny_gemm.PackedWeight.of(torch.zeros(16, 2, dtype=torch.bfloat16)) is None
