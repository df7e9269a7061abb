/* Fused elementwise ops of a Llama layer for CPU: each replaces several torch ops (and their temporaries)
 * with one pass over the rows.
 *
 * Every op rounds exactly where the Hugging Face reference rounds: in bfloat16, each torch op rounds its
 * float32 result to bf16, so a product that torch rounds before adding is rounded here too. Built with
 * -ffp-contract=off so that the compiler does not fuse a rounded multiply and add into one FMA.
 *
 * Plain C with OpenMP, called through ctypes (see pagedserve/kernels/fused_ops.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kv_quant.h"
#include "swiglu.h"

/* Below this many elements a single thread is faster than waking the pool. */
#define PARALLEL_MIN_ELEMS 32768

/* Element i of a bf16 or f32 array, as float32. */
static inline float load_at(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_at(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* v rounded to the storage dtype and back: what a torch op in that dtype would have produced. */
static inline float round_to(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* OpenMP outlines a parallel loop before functions are inlined, so a dtype flag passed into a function that
 * holds the pragma stays a runtime value inside the loop. Instead each op is a per-row function inlined with
 * a literal flag, and each entry point has one parallel loop per dtype. */
#define FOR_ROWS_BY_DTYPE(rows, threads, bf16, ROW_CALL)                                     \
    do {                                                                                     \
        if (bf16) {                                                                          \
            _Pragma("omp parallel for num_threads(threads) schedule(static)")               \
            for (int64_t r = 0; r < (rows); ++r) ROW_CALL(1);                               \
        } else {                                                                             \
            _Pragma("omp parallel for num_threads(threads) schedule(static)")               \
            for (int64_t r = 0; r < (rows); ++r) ROW_CALL(0);                               \
        }                                                                                    \
    } while (0)

/* RMSNorm of one row of length dim, optionally after adding x into the residual stream:
 *   residual != NULL: residual = round(residual + x); h = residual      (the layer's skip connection)
 *   residual == NULL: h = x
 *   out = round(weight * round(h * rsqrt(mean(h^2) + eps)))             (statistics in float32) */
static inline __attribute__((always_inline)) void rms_norm_row(const void *x, void *residual, const void *weight,
                                                               void *out, int64_t r, int64_t dim, float eps,
                                                               const int bf16) {
    float h[dim];
    const int64_t base = r * dim;
    float sum = 0.f;
    if (residual) {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; ++i) {
            const float v = round_to(load_at(residual, base + i, bf16) + load_at(x, base + i, bf16), bf16);
            store_at(residual, base + i, v, bf16);
            h[i] = v;
            sum += v * v;
        }
    } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; ++i) {
            const float v = load_at(x, base + i, bf16);
            h[i] = v;
            sum += v * v;
        }
    }
    const float inv_rms = 1.f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i)
        store_at(out, base + i, load_at(weight, i, bf16) * round_to(h[i] * inv_rms, bf16), bf16);
}

int rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t dim, float eps,
             int bf16, int num_threads) {
    if (dim > 65536) return 1;
    const int threads = rows * dim >= PARALLEL_MIN_ELEMS ? num_threads : 1;
#define ROW(BF16) rms_norm_row(x, residual, weight, out, r, dim, eps, BF16)
    FOR_ROWS_BY_DTYPE(rows, threads, bf16, ROW);
#undef ROW
    return 0;
}

/* Rotary embedding (rotate-half layout) applied in place to the q and k heads of a fused qkv projection,
 * then this step's k and v written into the paged KV cache.
 *
 * qkv: [tokens, row_stride] with q heads at column 0, k heads at num_heads * head_dim and v heads after them.
 * cos/sin: float32 [max_positions, head_dim] tables; they are rounded to the model dtype first, as the
 * reference casts them. For i < head_dim / 2, with x1 = x[i], x2 = x[i + half]:
 *   x[i]        = round(round(x1 * cos[i]) - round(x2 * sin[i]))
 *   x[i + half] = round(round(x2 * cos[i + half]) + round(x1 * sin[i + half]))
 * Caches (pagedserve/attention/kv_layout.py): V tiles [block_size][head_dim], K tiles
 * [head_dim / pack][block_size][pack] with pack = 2 in bf16 and 1 in f32; slot = block * block_size + offset
 * (< 0: not stored). With an 8-bit cache (kv_kind, kv_quant.h) the tiles hold codes (pack 1) and each
 * (token, head) of K and of V gets its bf16 scale at key_scale / value_scale [block][kv_head][block_size]. */
static inline __attribute__((always_inline)) void rotary_and_cache_row(
    void *qkv, int64_t row_stride, const int64_t *positions, const float *cos_table, const float *sin_table,
    void *key_cache, void *value_cache, uint16_t *key_scale, uint16_t *value_scale, const int64_t *slots,
    int64_t t, int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, const int kv_kind,
    const int bf16) {
    const int64_t half = head_dim / 2, elem = bf16 ? 2 : 4, pack = bf16 ? 2 : 1; /* pack * elem = 4 bytes */
    float c[head_dim], s[head_dim];
    const float *cos_row = cos_table + positions[t] * head_dim, *sin_row = sin_table + positions[t] * head_dim;
    for (int64_t i = 0; i < head_dim; ++i) {
        c[i] = round_to(cos_row[i], bf16);
        s[i] = round_to(sin_row[i], bf16);
    }
    const int64_t row = t * row_stride;
    for (int64_t head = 0; head < num_heads + kv_heads; ++head) {
        const int64_t at = row + head * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = load_at(qkv, at + i, bf16), x2 = load_at(qkv, at + half + i, bf16);
            const float lo = round_to(x1 * c[i], bf16) - round_to(x2 * s[i], bf16);
            const float hi = round_to(x2 * c[half + i], bf16) + round_to(x1 * s[half + i], bf16);
            store_at(qkv, at + i, lo, bf16);
            store_at(qkv, at + half + i, hi, bf16);
        }
    }
    const int64_t slot = slots[t];
    if (slot < 0) return;
    const int64_t block = slot / block_size, offset = slot % block_size;
    const char *k = (const char *)qkv + (row + num_heads * head_dim) * elem;
    const char *v = k + kv_heads * head_dim * elem;
    if (kv_is_quantized(kv_kind)) {
        for (int64_t h = 0; h < kv_heads; ++h) {
            const int64_t tile = (block * kv_heads + h) * block_size; /* tokens before this (block, head) */
            uint8_t *kq = (uint8_t *)key_cache + tile * head_dim + offset;
            uint8_t *vq = (uint8_t *)value_cache + (tile + offset) * head_dim;
            key_scale[tile + offset] = kv_quantize(k + h * head_dim * elem, bf16, head_dim, kq, block_size, kv_kind);
            value_scale[tile + offset] = kv_quantize(v + h * head_dim * elem, bf16, head_dim, vq, 1, kv_kind);
        }
        return;
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t tile = (block * kv_heads + h) * block_size * head_dim; /* elements */
        memcpy((char *)value_cache + (tile + offset * head_dim) * elem, v + h * head_dim * elem,
               (size_t)(head_dim * elem));
        /* K tiles are [head_dim / pack][block_size][pack]: pack dims (4 bytes) per token per group */
        const char *src = k + h * head_dim * elem;
        char *dst = (char *)key_cache + (tile + offset * pack) * elem;
        for (int64_t p = 0; p < head_dim / pack; ++p) memcpy(dst + p * block_size * 4, src + p * 4, 4);
    }
}

int rotary_and_cache(void *qkv, int64_t row_stride, const int64_t *positions, const float *cos_table,
                     const float *sin_table, void *key_cache, void *value_cache, uint16_t *key_scale,
                     uint16_t *value_scale, const int64_t *slots, int64_t tokens, int64_t num_heads,
                     int64_t kv_heads, int64_t head_dim, int64_t block_size, int kv_kind, int bf16,
                     int num_threads) {
    if (head_dim % 2 || head_dim > 1024) return 1;
    const int threads = tokens * (num_heads + 2 * kv_heads) * head_dim >= PARALLEL_MIN_ELEMS ? num_threads : 1;
#define ROW(BF16) rotary_and_cache_row(qkv, row_stride, positions, cos_table, sin_table, key_cache, value_cache, \
                                       key_scale, value_scale, slots, r, num_heads, kv_heads, head_dim, \
                                       block_size, kv_kind, BF16)
    FOR_ROWS_BY_DTYPE(tokens, threads, bf16, ROW);
#undef ROW
    return 0;
}

/* SwiGLU of one row of a fused gate/up projection [2 * d] (gate first): out[i] = round(round(silu(g)) * u), silu
 * as swiglu.h computes it. */
static inline __attribute__((always_inline)) void swiglu_row(const void *gate_up, void *out, int64_t r, int64_t d,
                                                             const int bf16) {
    const int64_t in = r * 2 * d, at = r * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) {
        const float g = load_at(gate_up, in + i, bf16), u = load_at(gate_up, in + d + i, bf16);
        store_at(out, at + i, round_to(silu_f32(g), bf16) * u, bf16);
    }
}

int swiglu(const void *gate_up, void *out, int64_t rows, int64_t d, int bf16, int num_threads) {
    const int threads = rows * d >= PARALLEL_MIN_ELEMS ? num_threads : 1;
#define ROW(BF16) swiglu_row(gate_up, out, r, d, BF16)
    FOR_ROWS_BY_DTYPE(rows, threads, bf16, ROW);
#undef ROW
    return 0;
}

/* A bf16 value as a 16-bit key ordered as the numbers are: -0 and +0 equal, every NaN above everything. */
static inline uint16_t bf16_order_key(uint16_t b) {
    if ((b & 0x7fff) > 0x7f80) return 0xffff; /* NaN */
    if (b == 0x8000) b = 0;                   /* -0 as +0 */
    return (b & 0x8000) ? (uint16_t)~b : (uint16_t)(b | 0x8000);
}

/* Greedy sampling: out[r] = the index of the first maximum of bf16 row r [n], as torch's max(dim=-1).indices
 * gives it (ties and -0 / +0 to the first, a NaN above every number, so the first NaN). Two passes of keys that
 * gcc vectorizes: the row's largest key, then the first 64-value block holding it and the index in that block
 * (torch's bf16 max took 3.5 ms for a W1 step's 256 x 49,152 logits). */
int argmax_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t *out, int num_threads) {
    if (n < 1) return 1;
    const int threads = rows * n >= PARALLEL_MIN_ELEMS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *row = x + r * n;
        uint16_t best = 0;
#pragma omp simd reduction(max : best)
        for (int64_t i = 0; i < n; ++i) {
            const uint16_t key = bf16_order_key(row[i]);
            best = key > best ? key : best;
        }
        int64_t at = 0;
        for (int64_t start = 0; start < n; start += 64) {
            const int64_t end = start + 64 < n ? start + 64 : n;
            int hit = 0;
#pragma omp simd reduction(| : hit)
            for (int64_t i = start; i < end; ++i) hit |= bf16_order_key(row[i]) == best;
            if (hit) {
                for (at = start; bf16_order_key(row[at]) != best; ++at) continue;
                break;
            }
        }
        out[r] = at;
    }
    return 0;
}
