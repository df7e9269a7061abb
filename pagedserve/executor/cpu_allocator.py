"""Keep freed memory in the process on CPU, so per-step activation buffers don't page-fault every step.

glibc returns large blocks (>= its mmap threshold, which adapts up to 32 MiB) to the OS when they are
freed, and a step allocates tens of MiB of activations and gathered K/V per layer: every step then pays the
page faults again. vLLM's CPU backend recommends preloading tcmalloc for the same reason; raising glibc's
thresholds with mallopt gets most of the benefit with no preload.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
_TRIM_THRESHOLD = 1 << 30
_configured = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process. Returns whether it took effect."""
    global _configured
    if _configured or not sys.platform.startswith("linux"):
        return _configured
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and ok
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    _configured = ok
    if ok:
        logger.debug("glibc malloc: mmap threshold 32 MiB, trim threshold 1 GiB")
    return ok
