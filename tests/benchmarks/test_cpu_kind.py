"""cpu_kind: benchmarks name the CPU kind they ran on, read from /proc/cpuinfo."""

from __future__ import annotations

from pagedserve.benchmarks import cpu_kind as ck


def test_cpu_kind_is_the_best_listed_flag_of_this_cpu():
    _, flags = ck._cpuinfo()
    expected = next((f for f, _ in ck.KINDS if f in flags), "other")
    assert ck.cpu_kind_flag() == expected
    assert ck.cpu_kind().endswith(f"({expected})")


def test_cpu_kind_prefers_amx_over_avx512_bf16_over_avx512_over_avx2(monkeypatch):
    for flags, kind in (({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "amx_bf16"),
                        ({"avx2", "avx512f", "avx512_bf16"}, "avx512_bf16"), ({"avx2", "avx512f"}, "avx512f"),
                        ({"avx2", "fma"}, "avx2"), ({"sse4_2"}, "other")):
        monkeypatch.setattr(ck, "_cpuinfo", lambda flags=flags: ("Some CPU", flags))
        assert ck.cpu_kind_flag() == kind
        assert ck.cpu_kind().startswith("Some CPU, ")


def test_amd_core_names_the_zen_generation_from_the_cpu_family():
    assert ck.amd_core(26, {"avx512f"}) == "Zen 5"
    assert ck.amd_core(25, {"avx2", "avx512f"}) == "Zen 4"
    assert ck.amd_core(25, {"avx2"}) == "Zen 3"
    assert ck.amd_core(23, {"avx2"}) == "Zen 1-2"
    assert ck.amd_core(6, {"avx2"}) is None  # an Intel family number


def test_cpu_kind_of_this_machine_names_its_amd_generation():
    with open("/proc/cpuinfo") as f:
        text = f.read()
    model, _ = ck._cpuinfo()
    if "AuthenticAMD" in text and any(f"cpu family\t: {n}\n" in text for n in (23, 25, 26)):
        assert "Zen " in model
    assert ck.cpu_kind().startswith(model)
