/* Linear layers on block-quantized weights (GGUF Q8_0, Q4_0, Q4_1, Q4_K kept quantized): y[M, N] = x[M, K] .
 * w[N, K]^T (+ bias), streaming the quantized weights once per pass, for any M.
 *
 * Weights come in groups of 32 consecutive k of one output column, each with a float32 scale d and offset m:
 *   kind 8: w = d * q, q int8                    (Q8_0)
 *   kind 4: w = d * q + m, q in 0..15 (4 bits)    (Q4_0: m = -8d; Q4_1; Q4_K's 32-value sub-blocks)
 * pack_weight lays them out once in records, one per (block of 16 columns, group of 32 k), front to back:
 *   codes: kind 8: [8 quads][16 columns][4 k] bytes holding q + 128 (512 bytes); kind 4: [4][16][4] bytes
 *          whose low nibbles hold quad j and high nibbles quad j + 4 (256 bytes: still 4 bits a weight)
 *   d[16], aux[16] float32: aux = m (kind 4), or -128 * d (kind 8, see below)
 * so a record is 640 (kind 8) or 384 (kind 4) bytes, about 1.25 / 0.75 bytes per weight's worth of file.
 *
 * Paths, by the build's -march (kernels/build.py):
 * - AVX-512 VNNI (Zen 4, Intel since Ice Lake): activations are quantized per row and group to int8
 *   (s = amax / 127, xq = round(x / s), as llama.cpp does), and one VPDPBUSD per quad adds 4 products of the
 *   unsigned codes (nibbles, or q + 128) and the signed xq into each of 16 column sums; for kind 8 the
 *   128 * sum(xq) that q + 128 adds is taken back through aux. Per group, y += s * (d * dot + aux * sum(xq)).
 * - everything else: each record is dequantized into a [32][16] float tile (w exactly as above, in float32),
 *   and every row's x (float32) is multiplied in with FMAs: no activation quantization.
 * Each output is summed in float32 in k order whatever M is, so a row's result does not depend on the batch.
 *
 * Plain C with OpenMP, called through ctypes (pagedserve/kernels/quant_gemm.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define GROUP 32
#define COLS 16
#define ROWS_PER_PASS 8

static inline int64_t code_bytes(int kind) { return kind == 8 ? 512 : 256; }
static inline int64_t record_bytes(int kind) { return code_bytes(kind) + 2 * COLS * (int64_t)sizeof(float); }

int vnni(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

/* Bytes pack_weight writes for a [n, k] weight of this kind. */
int64_t packed_bytes(int64_t n, int64_t k, int kind) { return (n / COLS) * (k / GROUP) * record_bytes(kind); }

/* codes [n, k] (int8 for kind 8, 0..15 for kind 4), d and m [n, k / 32] -> records (layout above). */
int pack_weight(const uint8_t *codes, const float *d, const float *m, uint8_t *packed, int64_t n, int64_t k,
                int kind) {
    if (n % COLS || k % GROUP || (kind != 8 && kind != 4)) return 1;
    const int64_t groups = k / GROUP;
    memset(packed, 0, (size_t)packed_bytes(n, k, kind)); /* kind 4 ORs the high nibbles in */
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < n / COLS; ++nb)
        for (int64_t g = 0; g < groups; ++g) {
            uint8_t *rec = packed + (nb * groups + g) * record_bytes(kind);
            float *rd = (float *)(rec + code_bytes(kind)), *ra = rd + COLS;
            for (int64_t c = 0; c < COLS; ++c) {
                const int64_t col = nb * COLS + c;
                const uint8_t *q = codes + col * k + g * GROUP;
                for (int64_t kk = 0; kk < GROUP; ++kk) {
                    const int64_t quad = kk / 4, at = kk % 4;
                    if (kind == 8) {
                        rec[(quad * COLS + c) * 4 + at] = (uint8_t)(q[kk] ^ 0x80u); /* q + 128, unsigned */
                    } else if (quad < 4) {
                        rec[(quad * COLS + c) * 4 + at] = (uint8_t)(q[kk] & 15);
                    } else {
                        rec[((quad - 4) * COLS + c) * 4 + at] |= (uint8_t)((q[kk] & 15) << 4);
                    }
                }
                rd[c] = d[col * groups + g];
                ra[c] = kind == 8 ? -128.f * d[col * groups + g] : m[col * groups + g];
            }
        }
    return 0;
}

/* Element i of a bf16 or f32 array, as float32. */
static inline float value_at(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* One row's 16 column sums of block nb, plus the bias, into y[row, nb * 16 ...] in the activation dtype. */
static inline void store_block_row(void *y, const float *sums, const void *bias, int64_t row, int64_t nb, int64_t n,
                                   int bf16) {
    for (int64_t c = 0; c < COLS; ++c) {
        const int64_t col = nb * COLS + c, at = row * n + col;
        const float v = sums[c] + (bias ? value_at(bias, col, bf16) : 0.f);
        if (bf16)
            ((uint16_t *)y)[at] = f32_to_bf16(v);
        else
            ((float *)y)[at] = v;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

/* x rows -> int8 codes [m][k], scales [m][k / 32] and code sums [m][k / 32] (per row and group). A group
 * holding a NaN or an infinity gets a NaN scale (its codes 0), so that the outputs it feeds are NaN, as
 * the float path's would be. */
static void quantize_rows(const void *x, int64_t m, int64_t k, int bf16, int8_t *xq, float *xs, int32_t *xsum,
                          int threads) {
    const int64_t groups = k / GROUP;
#pragma omp parallel for num_threads(m * k >= 16384 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < m; ++r) {
        float row[GROUP];
        for (int64_t g = 0; g < groups; ++g) {
            float amax = 0.f;
            int finite = 1;
            for (int64_t i = 0; i < GROUP; ++i) {
                const int64_t at = r * k + g * GROUP + i;
                row[i] = value_at(x, at, bf16);
                finite &= isfinite(row[i]);
                amax = fabsf(row[i]) > amax ? fabsf(row[i]) : amax;
            }
            if (!finite) {
                memset(xq + r * k + g * GROUP, 0, GROUP);
                xs[r * groups + g] = NAN;
                xsum[r * groups + g] = 0;
                continue;
            }
            const float s = amax / 127.f;
            int32_t sum = 0;
            for (int64_t i = 0; i < GROUP; ++i) {
                const int8_t q = s > 0.f ? (int8_t)nearbyintf(row[i] / s) : 0;
                xq[r * k + g * GROUP + i] = q;
                sum += q;
            }
            xs[r * groups + g] = s;
            xsum[r * groups + g] = sum;
        }
    }
}

/* Rows [r0, r0 + rows) of column block nb. Per group, each code vector is used by every row (the rows'
 * int32 sums are independent chains, interleaved), and each row's quad of xq is a broadcast operand. */
static inline __attribute__((always_inline)) void block_vnni(const int8_t *xq, const float *xs, const int32_t *xsum,
                                                            const uint8_t *packed, const void *bias, void *y,
                                                            int64_t r0, int64_t rows, int64_t nb, int64_t n,
                                                            int64_t k, const int kind, int bf16) {
    const int64_t groups = k / GROUP;
    __m512 f[ROWS_PER_PASS];
    for (int64_t r = 0; r < ROWS_PER_PASS; ++r) f[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *rec = packed + (nb * groups + g) * record_bytes(kind);
        __m512i w[8];
        if (kind == 8) {
            for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(rec + 64 * j);
        } else {
            for (int j = 0; j < 4; ++j) {
                const __m512i v = _mm512_loadu_si512(rec + 64 * j);
                w[j] = _mm512_and_si512(v, low);
                w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        }
        __m512i acc[ROWS_PER_PASS];
        for (int64_t r = 0; r < ROWS_PER_PASS; ++r) acc[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j)
            for (int64_t r = 0; r < rows; ++r) {
                int32_t quad;
                memcpy(&quad, xq + (r0 + r) * k + g * GROUP + 4 * j, sizeof quad);
                acc[r] = _mm512_dpbusd_epi32(acc[r], w[j], _mm512_set1_epi32(quad));
            }
        const __m512 dv = _mm512_loadu_ps((const float *)(rec + code_bytes(kind)));
        const __m512 av = _mm512_loadu_ps((const float *)(rec + code_bytes(kind)) + COLS);
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t row = r0 + r;
            const float s = xs[row * groups + g];
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(dv, _mm512_set1_ps(s)), f[r]);
            f[r] = _mm512_fmadd_ps(av, _mm512_set1_ps(s * (float)xsum[row * groups + g]), f[r]);
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        float sums[COLS];
        _mm512_storeu_ps(sums, f[r]);
        store_block_row(y, sums, bias, r0 + r, nb, n, bf16);
    }
}

/* A full pass (and a single row) takes a literal row count, so that its loops unroll and the per-row sums stay in
 * registers. */
#define BLOCK_CALL(KIND)                                                                                  \
    do {                                                                                                  \
        if (rows == ROWS_PER_PASS)                                                                        \
            block_vnni(xq, xs, xsum, packed, bias, y, r0, ROWS_PER_PASS, nb, n, k, KIND, bf16);           \
        else if (rows == 1) /* single-stream decode */                                                    \
            block_vnni(xq, xs, xsum, packed, bias, y, r0, 1, nb, n, k, KIND, bf16);                       \
        else                                                                                              \
            block_vnni(xq, xs, xsum, packed, bias, y, r0, rows, nb, n, k, KIND, bf16);                    \
    } while (0)

int quant_gemm(const void *x, const uint8_t *packed, const void *bias, void *y, int64_t m, int64_t n, int64_t k,
               int kind, int bf16, int threads) {
    if (n % COLS || k % GROUP || (kind != 8 && kind != 4)) return 1;
    int8_t *xq = malloc((size_t)(m * k));
    float *xs = malloc(sizeof(float) * (size_t)(m * (k / GROUP)));
    int32_t *xsum = malloc(sizeof(int32_t) * (size_t)(m * (k / GROUP)));
    if (!xq || !xs || !xsum) {
        free(xq), free(xs), free(xsum);
        return 2;
    }
    quantize_rows(x, m, k, bf16, xq, xs, xsum, threads);
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int64_t nb = 0; nb < n / COLS; ++nb)
        for (int64_t r0 = 0; r0 < m; r0 += ROWS_PER_PASS) {
            const int64_t rows = m - r0 < ROWS_PER_PASS ? m - r0 : ROWS_PER_PASS;
            if (kind == 8)
                BLOCK_CALL(8);
            else
                BLOCK_CALL(4);
        }
    free(xq), free(xs), free(xsum);
    return 0;
}

#else /* dequantize each record into a float tile */

/* Record (nb, g) as tile[kk][c] = the weight of column nb * 16 + c at k = g * 32 + kk. */
static inline void record_to_tile(const uint8_t *rec, int kind, float tile[GROUP][COLS]) {
    const float *d = (const float *)(rec + code_bytes(kind)), *m = d + COLS;
    for (int64_t kk = 0; kk < GROUP; ++kk) {
        const int64_t quad = kk / 4, at = kk % 4;
        for (int64_t c = 0; c < COLS; ++c) {
            if (kind == 8) {
                tile[kk][c] = d[c] * (float)((int)rec[(quad * COLS + c) * 4 + at] - 128);
            } else {
                const uint8_t byte = rec[((quad % 4) * COLS + c) * 4 + at];
                tile[kk][c] = d[c] * (float)(quad < 4 ? byte & 15 : byte >> 4) + m[c];
            }
        }
    }
}

int quant_gemm(const void *x, const uint8_t *packed, const void *bias, void *y, int64_t m, int64_t n, int64_t k,
               int kind, int bf16, int threads) {
    if (n % COLS || k % GROUP || (kind != 8 && kind != 4)) return 1;
    float *xf = malloc(sizeof(float) * (size_t)(m * k));
    if (!xf) return 2;
    for (int64_t i = 0; i < m * k; ++i) xf[i] = value_at(x, i, bf16);
    const int64_t groups = k / GROUP;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int64_t nb = 0; nb < n / COLS; ++nb)
        for (int64_t r0 = 0; r0 < m; r0 += ROWS_PER_PASS) {
            const int64_t rows = m - r0 < ROWS_PER_PASS ? m - r0 : ROWS_PER_PASS;
            float acc[ROWS_PER_PASS][COLS] = {{0.f}}, tile[GROUP][COLS];
            for (int64_t g = 0; g < groups; ++g) {
                record_to_tile(packed + (nb * groups + g) * record_bytes(kind), kind, tile);
                for (int64_t r = 0; r < rows; ++r) {
                    const float *xr = xf + (r0 + r) * k + g * GROUP;
                    for (int64_t kk = 0; kk < GROUP; ++kk)
#pragma omp simd
                        for (int64_t c = 0; c < COLS; ++c) acc[r][c] += xr[kk] * tile[kk][c];
                }
            }
            for (int64_t r = 0; r < rows; ++r) store_block_row(y, acc[r], bias, r0 + r, nb, n, bf16);
        }
    free(xf);
    return 0;
}
#endif
