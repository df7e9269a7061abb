/* silu(g) = g / (1 + exp(-g)) in float32 as torch computes it, shared by fused_ops.c's SwiGLU and the matmul
 * that ends in SwiGLU (skinny_gemm.c), so that both give the same bits. exp of a non-positive argument only,
 * so that it vectorizes: for g < 0 the same quotient is g * e / (1 + e) with e = exp(g). The exp polynomial may
 * differ from torch's in the last float32 bit, so in bfloat16 a result can differ from torch's by one rounding
 * step. (Included by the kernel sources; kernels/build.py rebuilds them when this file changes.) */
#ifndef PAGEDSERVE_SWIGLU_H
#define PAGEDSERVE_SWIGLU_H

#include <math.h>

#include "fast_exp.h"

static inline float silu_f32(float g) {
    const float e = exp_nonpositive(-fabsf(g));
    return g >= 0.f ? g / (1.f + e) : g * e / (1.f + e);
}

#endif
