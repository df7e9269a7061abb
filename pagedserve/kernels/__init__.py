"""CPU kernels in plain C (csrc/), compiled with gcc on first use and called through ctypes."""
