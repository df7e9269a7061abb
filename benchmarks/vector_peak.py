"""Peak rate of this CPU's vector dot-product instructions, from register-only loops (no memory traffic):
what a matmul kernel could reach at most, to put benchmarks/roofline.py's measured GEMM rates beside.

    python benchmarks/vector_peak.py [--threads 2] [--iterations 60000000]

Builds a small C loop per instruction with gcc (-march=native) and runs it on each thread at once; prints
GFLOP/s (a multiply and an add are 2, also for int8 products) per thread and in total. Each loop keeps 12
independent sums, so only the instruction's throughput limits it. An instruction this CPU lacks is skipped.
Seen on Zen 4 (2026-12-07, one thread): bf16 dot products (VDPBF16PS, 512-bit) 226 GFLOP/s, 8-bit ones
(VPDPBUSD, 256- or 512-bit) 455, float32 FMAs (256- or 512-bit) 114-115: 8-bit weights may compute twice as fast
as bf16 ones there.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

_LOOP = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
/* 12 independent sums, in registers (an array here would be spilled around the OpenMP region's body): enough to
 * cover the latency of these instructions, and with a and b within AVX2's 16 registers. */
static __attribute__((noinline)) VEC loop(long iters, VEC a, VEC b) {
    /* different starting values, so that the compiler cannot merge the chains into one */
    VEC c0 = SET1(0), c1 = SET1(1), c2 = SET1(2), c3 = SET1(3), c4 = SET1(4), c5 = SET1(5);
    VEC c6 = SET1(6), c7 = SET1(7), c8 = SET1(8), c9 = SET1(9), c10 = SET1(10), c11 = SET1(11);
    for (long it = 0; it < iters; ++it) {
        c0 = OP(c0, a, b); c1 = OP(c1, a, b); c2 = OP(c2, a, b); c3 = OP(c3, a, b);
        c4 = OP(c4, a, b); c5 = OP(c5, a, b); c6 = OP(c6, a, b); c7 = OP(c7, a, b);
        c8 = OP(c8, a, b); c9 = OP(c9, a, b); c10 = OP(c10, a, b); c11 = OP(c11, a, b);
        /* the sums pass through an empty asm: kept in registers, never folded or hoisted by the compiler */
        __asm__ volatile("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5));
        __asm__ volatile("" : "+v"(c6), "+v"(c7), "+v"(c8), "+v"(c9), "+v"(c10), "+v"(c11));
    }
    c0 = ADD(ADD(ADD(c0, c1), ADD(c2, c3)), ADD(c4, c5));
    c6 = ADD(ADD(ADD(c6, c7), ADD(c8, c9)), ADD(c10, c11));
    return ADD(c0, c6);
}
int main(void) {
    const long iters = ITERATIONS;
#pragma omp parallel
    {
        const double start = now();
        volatile VEC sink = loop(iters, SET1(0x3f803f80), SET1(0x01010101));
        const double seconds = now() - start;
        (void)sink;
#pragma omp critical
        printf("%d %.1f\n", omp_get_thread_num(), iters * 12.0 * FLOPS / seconds / 1e9);
    }
    return 0;
}
"""

# name: (CPU flag, C type, set1, op(acc, a, b), add, flops per instruction)
_KINDS = {
    "bf16 dot, 512-bit (VDPBF16PS)": ("avx512_bf16", "__m512", "_mm512_castsi512_ps(_mm512_set1_epi32(X))",
                                      "_mm512_dpbf16_ps(c, (__m512bh)a, (__m512bh)b)", "_mm512_add_ps(x, y)", 64),
    "int8 dot, 512-bit (VPDPBUSD)": ("avx512_vnni", "__m512i", "_mm512_set1_epi32(X)",
                                     "_mm512_dpbusd_epi32(c, a, b)", "_mm512_add_epi32(x, y)", 128),
    "int8 dot, 256-bit (VPDPBUSD)": ("avx512_vnni", "__m256i", "_mm256_set1_epi32(X)",
                                     "_mm256_dpbusd_epi32(c, a, b)", "_mm256_add_epi32(x, y)", 64),
    "fp32 FMA, 512-bit": ("avx512f", "__m512", "_mm512_castsi512_ps(_mm512_set1_epi32(X))",
                          "_mm512_fmadd_ps(a, b, c)", "_mm512_add_ps(x, y)", 32),
    "fp32 FMA, 256-bit": ("fma", "__m256", "_mm256_castsi256_ps(_mm256_set1_epi32(X))",
                          "_mm256_fmadd_ps(a, b, c)", "_mm256_add_ps(x, y)", 16),
}


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def measure(kind: tuple, threads: int, workdir: str, iterations: int = 60_000_000) -> list[float]:
    """GFLOP/s of one _KINDS entry on each of `threads` threads (one loop of `iterations` rounds each)."""
    _, vec, set1, op, add, flops = kind
    defines = [f"-DVEC={vec}", f"-DSET1(X)={set1}", f"-DOP(c,a,b)={op}", f"-DADD(x,y)={add}",
               f"-DFLOPS={flops}", f"-DITERATIONS={iterations}L"]
    src, exe = os.path.join(workdir, "peak.c"), os.path.join(workdir, "peak")
    with open(src, "w") as f:
        f.write(_LOOP)
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", *defines, src, "-o", exe], check=True)
    out = subprocess.run([exe], check=True, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "true"}).stdout
    return [float(line.split()[1]) for line in out.splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--iterations", type=int, default=60_000_000, help="rounds of the loop per thread")
    args = parser.parse_args()
    if args.threads < 1 or args.iterations < 1:
        parser.error("--threads and --iterations must be at least 1")
    flags = cpu_flags()
    with tempfile.TemporaryDirectory() as workdir:
        for name, kind in _KINDS.items():
            if kind[0] not in flags:
                print(f"{name:34s} skipped: this CPU has no {kind[0]}")
                continue
            rates = measure(kind, args.threads, workdir, args.iterations)
            print(f"{name:34s} {sum(rates):7.1f} GFLOP/s on {len(rates)} threads "
                  f"({', '.join(f'{r:.1f}' for r in rates)})")


if __name__ == "__main__":
    main()
