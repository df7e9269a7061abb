"""CPU kernels in plain C (csrc/), compiled with gcc on first use for the CPU's ISA level (build.py: avx512_bf16,
avx512, avx2, generic, chosen at run time) and called through ctypes."""
