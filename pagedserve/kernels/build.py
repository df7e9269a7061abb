"""Compile a C kernel file once per machine and load it with ctypes.

A library is built into ~/.cache/pagedserve (PAGEDSERVE_CACHE_DIR overrides), keyed by its source, the
headers beside it, the flags and the CPU's feature flags, since it is compiled for this CPU with -march=native. If there is no compiler or
the build fails, `load_library` returns None (logged once) and callers use their torch path;
PAGEDSERVE_CPU_KERNEL=0 turns every kernel off. The libraries use OpenMP: inside a process that imported
torch they bind to torch's own libgomp (same soname), so there is one thread pool, not two.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fno-trapping-math",
         "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_loaded: dict[str, Optional[ctypes.CDLL]] = {}


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_CPU_KERNEL", "1") != "0"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(source: Path, flags: list[str]) -> Path:
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(text + " ".join(flags).encode() + _cpu_flags().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PAGEDSERVE_CACHE_DIR", Path.home() / ".cache" / "pagedserve"))
    target = cache / f"{source.stem}-{key}.so"
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
    """csrc/<name>.c compiled and loaded (cached per process), or None when kernels are off or it can't build."""
    if name in _loaded:
        return _loaded[name]
    library = None
    if enabled():
        try:
            library = ctypes.CDLL(str(_build(CSRC / f"{name}.c", FLAGS + list(extra_flags))))
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            logger.warning("CPU kernel %s unavailable (%s); using the torch path", name, detail.strip()[:500])
    _loaded[name] = library
    return library
