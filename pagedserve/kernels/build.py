"""Compile a C kernel file once per machine and ISA level, and load it with ctypes.

The ISA level is chosen at run time from this CPU's flags (/proc/cpuinfo), never from the machine that
built or installed the package:

    level        CPU flags needed                          gcc flags
    avx512_bf16  avx512f avx512bw avx512vl avx512_bf16     -march=native -mprefer-vector-width=512
    avx512       avx512f avx512bw avx512vl (cd, dq)        -march=x86-64-v4 -mtune=native
    avx2         avx2 fma (f16c, bmi1, bmi2)               -march=x86-64-v3 -mtune=native
    generic      none                                      -march=x86-64-v2 (no -march off x86)

Each level needs the flags of the levels below it too (the flags in parentheses are what the x86-64-v4/v3
targets also let gcc emit). The avx2 and avx512 levels also take -mavxvnni where the CPU has `avx_vnni`, and
avx512 takes -mavx512vnni where it has `avx512_vnni` (Cascade Lake, Ice Lake: VNNI without AVX512-BF16), for
quant_gemm's int8 dot products. Intel CPUs with AMX-BF16 also have AVX512-BF16 and take the avx512_bf16 level
(there skinny_gemm hands batches of more than 32 rows to torch's oneDNN, on AMX tiles, if it times faster at load);
AMD EPYC before Zen 4 takes avx2. PAGEDSERVE_CPU_ISA=<level> forces a level at or below the CPU's (to test
or measure a lower path on a bigger CPU); an unknown level, or one this CPU cannot run, is a ValueError.
`cpu_isa()` names the level in force.

Paths per level, by kernel (the C sources choose them with #if on the compiler's __AVX512BF16__, __AVX512F__,
__AVX2__/__FMA__ macros, which the -march flags above set):

    kernel             avx512_bf16             avx512                  avx2                 generic
    skinny_gemm        AVX-512 BF16 dots       AVX2+FMA fp32           AVX2+FMA fp32        none (torch)
    decode_attention   AVX-512 (+ BF16 dots)   AVX-512 fp32 FMA        AVX2+FMA             plain C
    fused_ops          plain C, auto-vectorized for the level (bit-exact at every level)
    quant_gemm         AVX512-VNNI int8 dots    AVX512-VNNI int8 dots*  AVX-VNNI int8 dots*  float32 tiles
    f32_gemm           none (torch's sgemm)     none (torch's sgemm)    AVX2+FMA fp32        none (torch)

    * where the CPU has avx512_vnni (avx512) or avx_vnni (avx2, avx512): the optional flags above; else AVX2's
      maddubs, with the same int32 sums (so the same results bit for bit).

A library is built into ~/.cache/pagedserve (PAGEDSERVE_CACHE_DIR overrides), keyed by its source, the
headers beside it, the flags (so the level) and the CPU's feature flags. If there is no compiler or the
build fails, `load_library` returns None (logged once) and callers use their torch path;
PAGEDSERVE_CPU_KERNEL=0 turns every kernel off. The libraries use OpenMP: inside a process that imported
torch they bind to torch's own libgomp (same soname), so there is one thread pool, not two.

The level and the loaded libraries are kept per process; `reset()` forgets them (tests that switch
PAGEDSERVE_CPU_ISA call it; the kernel wrappers keep no state of their own beyond what load_library returns).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Iterable, Optional

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
COMMON_FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared", "-std=c11"]

ISA_LEVELS = ("generic", "avx2", "avx512", "avx512_bf16")
"""From lowest to highest."""

_REQUIRED = {  # CPU flags each level adds to the one below it
    "generic": (),
    "avx2": ("avx2", "fma", "f16c", "bmi1", "bmi2"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512cd", "avx512dq"),
    "avx512_bf16": ("avx512_bf16",),
}
_MARCH = {
    "avx512_bf16": ["-march=native", "-mprefer-vector-width=512"],
    "avx512": ["-march=x86-64-v4", "-mtune=native"],
    "avx2": ["-march=x86-64-v3", "-mtune=native"],
    "generic": ["-march=x86-64-v2"],
}

_OPTIONAL = (  # (lowest level, CPU flag, gcc flag): added at that level and above where the CPU has the flag
    ("avx2", "avx_vnni", "-mavxvnni"),  # 256-bit int8 dot products: Alder Lake and later, Sierra Forest, Zen 5
    ("avx512", "avx512_vnni", "-mavx512vnni"),  # 512-bit ones without AVX512-BF16: Cascade Lake, Ice Lake
)
"""Features a level's -march does not promise but a kernel uses where the CPU has them (quant_gemm's VNNI
paths); avx512_bf16 builds with -march=native, which has them already."""

_loaded: dict[str, Optional[ctypes.CDLL]] = {}
_level: Optional[str] = None


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_CPU_KERNEL", "1") != "0"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def cpu_flags() -> list[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where it has none)."""
    return _cpu_flags().split(":", 1)[-1].split()


def detect_isa(flags: Iterable[str]) -> str:
    """The highest level whose CPU flags (and those of every level below) are all in `flags`."""
    flags, best = set(flags), "generic"
    for level in ISA_LEVELS[1:]:
        if not flags.issuperset(_REQUIRED[level]):
            break
        best = level
    return best


def _on_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def native_isa() -> str:
    """This CPU's own level (PAGEDSERVE_CPU_ISA aside); generic off x86."""
    return detect_isa(cpu_flags()) if _on_x86() else "generic"


def choose_isa(override: Optional[str], flags: Iterable[str]) -> str:
    """The level for a CPU with `flags`, or `override` (a PAGEDSERVE_CPU_ISA value) if the CPU can run it."""
    detected = detect_isa(flags)
    if not override:
        return detected
    if override not in ISA_LEVELS:
        raise ValueError(f"PAGEDSERVE_CPU_ISA={override!r} is not a level; allowed: {', '.join(ISA_LEVELS)}")
    if ISA_LEVELS.index(override) > ISA_LEVELS.index(detected):
        allowed = ", ".join(ISA_LEVELS[: ISA_LEVELS.index(detected) + 1])
        raise ValueError(f"PAGEDSERVE_CPU_ISA={override!r}: this CPU cannot run it (its level is {detected}); "
                         f"allowed here: {allowed}")
    return override


def cpu_isa() -> str:
    """The ISA level the kernels are built for in this process: this CPU's, or PAGEDSERVE_CPU_ISA's."""
    global _level
    if _level is None:
        flags = cpu_flags() if _on_x86() else ()
        _level = choose_isa(os.environ.get("PAGEDSERVE_CPU_ISA"), flags)
        logger.info("CPU kernels: ISA level %s", _level)
    return _level


def flags_for(level: str) -> list[str]:
    """gcc flags for a level (off x86, generic builds for the compiler's default target)."""
    if level == "generic" and not _on_x86():
        return list(COMMON_FLAGS)
    return [*COMMON_FLAGS, *_MARCH[level], *optional_flags(level, cpu_flags())]


def optional_flags(level: str, cpu_flags: Iterable[str]) -> list[str]:
    """The gcc flags of _OPTIONAL that a build at `level` takes on a CPU with `cpu_flags`."""
    if level == "avx512_bf16":
        return []
    cpu_flags = set(cpu_flags)
    return [gcc for lowest, flag, gcc in _OPTIONAL
            if ISA_LEVELS.index(level) >= ISA_LEVELS.index(lowest) and flag in cpu_flags]


def reset() -> None:
    """Forget the level and the loaded libraries, so that the next load reads PAGEDSERVE_CPU_ISA again.
    Libraries already handed out stay loaded; layers that packed weights keep them in that level's layout."""
    global _level
    _level = None
    _loaded.clear()


def _build(source: Path, flags: list[str]) -> Path:
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(text + " ".join(flags).encode() + _cpu_flags().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PAGEDSERVE_CACHE_DIR", Path.home() / ".cache" / "pagedserve"))
    target = cache / f"{source.stem}-{cpu_isa()}-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CC", "gcc")
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # build aside, then rename: safe under concurrency
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, str(source), "-o", str(built), "-lm"], check=True,
                       capture_output=True, text=True)
        os.replace(built, target)
    return target


def load_library(name: str, extra_flags: tuple[str, ...] = ()) -> Optional[ctypes.CDLL]:
    """csrc/<name>.c compiled for `cpu_isa()` and loaded (cached per process), or None when kernels are off
    or it can't build. Raises ValueError for a PAGEDSERVE_CPU_ISA this CPU cannot run."""
    if name in _loaded:
        return _loaded[name]
    library = None
    if enabled():
        flags = flags_for(cpu_isa()) + list(extra_flags)
        library, detail = _try_build(name, flags)
        optional = [f for f in flags if f in {gcc for _, _, gcc in _OPTIONAL}]
        if library is None and optional:  # a gcc too old for -mavxvnni: the level's own path still builds
            logger.warning("CPU kernel %s: no build with %s (%s); building without", name, " ".join(optional), detail)
            library, detail = _try_build(name, [f for f in flags if f not in optional])
        if library is None:
            logger.warning("CPU kernel %s unavailable (%s); using the torch path", name, detail)
    _loaded[name] = library
    return library


def _try_build(name: str, flags: list[str]) -> tuple[Optional[ctypes.CDLL], str]:
    """The library built with `flags` and loaded, or None and why not."""
    try:
        return ctypes.CDLL(str(_build(CSRC / f"{name}.c", flags))), ""
    except (OSError, subprocess.CalledProcessError) as e:
        return None, (getattr(e, "stderr", "") or str(e)).strip()[:500]
