/* exp for non-positive arguments, in plain C that gcc vectorizes (libm's expf does not vectorize without
 * -ffast-math). Shared by the kernels that need it; a change here rebuilds them (build.py hashes headers). */
#ifndef PAGEDSERVE_FAST_EXP_H
#define PAGEDSERVE_FAST_EXP_H

#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (scores minus their max), vectorizable, unlike libm's expf without -ffast-math:
 * exp(x) = 2^n * 2^f with n = round(x * log2 e) and |f| <= 1/2; 2^f by its Taylor series to degree 7,
 * whose truncation error (<= (ln2 / 2)^8 / 8! ~ 5e-9) is below float32 rounding. */
static inline float exp_nonpositive(float x) {
    const float t = (x < -87.f ? -87.f : x) * 1.4426950408889634f;
    const float n = __builtin_floorf(t + 0.5f), f = (t - n) * 0.6931471805599453f;
    float p = 1.f / 5040.f;
    p = p * f + 1.f / 720.f;
    p = p * f + 1.f / 120.f;
    p = p * f + 1.f / 24.f;
    p = p * f + 1.f / 6.f;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
