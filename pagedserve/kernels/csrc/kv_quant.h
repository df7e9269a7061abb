/* 8-bit KV-cache elements for the CPU kernels: the cache kinds, and scalar encode/decode that round exactly as
 * torch does (pagedserve/quantization/kv_cache.py is the reference the tests hold these to).
 *
 * A quantized cache stores, per (token, kv head), head_dim 8-bit codes and one bfloat16 scale:
 *   scale = bf16(amax / QMAX)  (1 when that is 0),   code = encode(clamp(x / scale, -QMAX, QMAX)),
 *   value = decode(code) * scale                      (exact in float32: <= 8 significant bits each)
 * with QMAX 127 for int8 (round half to even), 448 for fp8 e4m3 ("fn": no infinities) and 57344 for e5m2
 * (both round to nearest even, subnormals included). */
#ifndef PAGEDSERVE_KV_QUANT_H
#define PAGEDSERVE_KV_QUANT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

enum { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2, KV_FP8_E4M3 = 3, KV_FP8_E5M2 = 4 };

static inline int kv_is_quantized(int kind) { return kind >= KV_INT8; }

static inline float kv_qmax(int kind) {
    return kind == KV_INT8 ? 127.f : kind == KV_FP8_E4M3 ? 448.f : 57344.f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* |x| <= 448 (callers clamp) to e4m3fn, round to nearest even. Below 2^-6 the codes are m * 2^-9. */
static inline uint8_t f32_to_e4m3(float x) {
    const uint8_t sign = (uint8_t)((f32_bits(x) >> 24) & 0x80u);
    const float a = fabsf(x);
    if (a < 0x1p-6f) return sign | (uint8_t)nearbyintf(a * 512.f); /* 8 rounds up to the smallest normal */
    uint32_t u = f32_bits(a);
    u += 0x7ffffu + ((u >> 20) & 1u); /* round the mantissa to 3 bits; a carry moves into the exponent */
    return sign | (uint8_t)((((u >> 23) - 120u) << 3) | ((u >> 20) & 7u));
}

/* |x| <= 57344 to e5m2 (the top byte of a float16), round to nearest even. Below 2^-14: m * 2^-16. */
static inline uint8_t f32_to_e5m2(float x) {
    const uint8_t sign = (uint8_t)((f32_bits(x) >> 24) & 0x80u);
    const float a = fabsf(x);
    if (a < 0x1p-14f) return sign | (uint8_t)nearbyintf(a * 65536.f);
    uint32_t u = f32_bits(a);
    u += 0xfffffu + ((u >> 21) & 1u);
    return sign | (uint8_t)((((u >> 23) - 112u) << 2) | ((u >> 21) & 3u));
}

static inline float e4m3_to_f32(uint8_t c) {
    const int e = (c >> 3) & 15, m = c & 7;
    const float v = e ? ldexpf(1.f + (float)m / 8.f, e - 7) : (float)m * 0x1p-9f;
    return (c & 0x80) ? -v : v;
}

static inline float e5m2_to_f32(uint8_t c) {
    const int e = (c >> 2) & 31, m = c & 3;
    const float v = e ? ldexpf(1.f + (float)m / 4.f, e - 15) : (float)m * 0x1p-16f;
    return (c & 0x80) ? -v : v;
}

/* The code of x (already divided by its scale and clamped to +-QMAX). NaN (a model that blew up) stays NaN:
 * the fp8 NaN code, or for int8 a code of 0 whose scale is NaN. */
static inline uint8_t kv_encode(float x, int kind) {
    if (x != x) return kind == KV_INT8 ? 0 : 0x7f;
    if (kind == KV_INT8) return (uint8_t)(int8_t)nearbyintf(x);
    return kind == KV_FP8_E4M3 ? f32_to_e4m3(x) : f32_to_e5m2(x);
}

/* A code's value before its scale. */
static inline float kv_decode(uint8_t c, int kind) {
    if (kind == KV_INT8) return (float)(int8_t)c;
    return kind == KV_FP8_E4M3 ? e4m3_to_f32(c) : e5m2_to_f32(c);
}

/* The bf16 scale of a vector whose largest magnitude is amax. */
static inline uint16_t kv_scale(float amax, int kind) {
    const uint16_t s = f32_to_bf16(amax / kv_qmax(kind));
    return (s & 0x7fffu) == 0 ? 0x3f80u /* 1.0 */ : s;
}

/* count values of src (bf16 or f32) -> codes at dst[i * stride], returning their bf16 scale. */
static inline uint16_t kv_quantize(const void *src, int bf16, int64_t count, uint8_t *dst, int64_t stride,
                                   int kind) {
    float amax = 0.f;
    for (int64_t i = 0; i < count; ++i) {
        const float v = fabsf(bf16 ? bf16_to_f32(((const uint16_t *)src)[i]) : ((const float *)src)[i]);
        amax = v > amax || v != v ? v : amax; /* a NaN wins, as in torch's amax */
        if (amax != amax) break;
    }
    const uint16_t scale = kv_scale(amax, kind);
    const float s = bf16_to_f32(scale), qmax = kv_qmax(kind);
    for (int64_t i = 0; i < count; ++i) {
        float x = (bf16 ? bf16_to_f32(((const uint16_t *)src)[i]) : ((const float *)src)[i]) / s;
        x = x > qmax ? qmax : x < -qmax ? -qmax : x;
        dst[i * stride] = kv_encode(x, kind);
    }
    return scale;
}

#endif
