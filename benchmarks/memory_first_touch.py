"""What committing memory costs on this machine: fresh, taken again after this process gave it back, and in a
new process some seconds after another one gave it back (the host may take freed memory back meanwhile).

    python benchmarks/memory_first_touch.py [--mib 1024] [--delays 0,5,20]

Each figure is seconds per GiB of MADV_POPULATE_WRITE over anonymous memory that asks for huge pages, as the
KV cache's commit does (executor/kv_commit.py). On the project's VMs the host backs guest memory when it is
first touched; seen on Zen 4 (2026-12-07): fresh 2.3-2.4 s per GiB, given back and taken again 0.09-0.10 s, in
a new process 0 / 5 / 20 s after another gave it back 0.09-0.10 / 0.34-1.03 / 2.26-2.41 s. That is why a server started right
after another one stopped is ready sooner than a first start (compare_engines.py --settle-s).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import subprocess
import sys
import time

from pagedserve.executor.cpu_allocator import libc
from pagedserve.executor.kv_commit import _MADV_POPULATE_WRITE

_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


def _libc() -> ctypes.CDLL:
    lib = libc()
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib


def commit_seconds_per_gib(num_bytes: int) -> float:
    """Map num_bytes, commit them, unmap them; seconds per GiB of the commit. OSError where it cannot commit."""
    lib = _libc()
    address = lib.mmap(None, num_bytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                       -1, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    try:
        lib.madvise(address, num_bytes, _MADV_HUGEPAGE)
        start = time.perf_counter()
        if lib.madvise(address, num_bytes, _MADV_POPULATE_WRITE):
            raise OSError(ctypes.get_errno(), "MADV_POPULATE_WRITE failed (Linux >= 5.14 has it)")
        return (time.perf_counter() - start) * 2**30 / num_bytes
    finally:
        lib.munmap(address, num_bytes)


def in_new_process(num_bytes: int) -> float:
    """commit_seconds_per_gib in a fresh interpreter."""
    out = subprocess.run([sys.executable, __file__, "--child-bytes", str(num_bytes)], capture_output=True, text=True,
                         check=True).stdout
    return float(out.strip().splitlines()[-1])


def measure(num_bytes: int, delays: list[float]) -> dict:
    result = {"fresh": commit_seconds_per_gib(num_bytes), "again": commit_seconds_per_gib(num_bytes)}
    for delay in delays:
        commit_seconds_per_gib(num_bytes)  # given back just now
        time.sleep(delay)
        result[f"new process {delay:g} s later"] = in_new_process(num_bytes)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--delays", default="0,5,20", help="seconds between giving memory back and a new process")
    parser.add_argument("--child-bytes", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_bytes is not None:
        print(commit_seconds_per_gib(args.child_bytes))
        return
    if args.mib < 1:
        parser.error("--mib must be at least 1")
    delays = [float(d) for d in args.delays.split(",") if d.strip()]
    result = measure(args.mib << 20, delays)
    for name, seconds in result.items():
        print(f"{name:28s} {seconds:.2f} s per GiB")
    print(json.dumps({"mib": args.mib, "seconds_per_gib": result}))


if __name__ == "__main__":
    main()
