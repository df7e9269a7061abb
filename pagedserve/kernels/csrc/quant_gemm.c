/* Linear layers on block-quantized weights (GGUF Q8_0, Q4_0, Q4_1, Q4_K, Q6_K kept quantized): y[M, N] = x[M, K] .
 * w[N, K]^T (+ bias), streaming the quantized weights once per pass, for any M.
 *
 * Weights come in groups of 32 consecutive k of one output column, each with a scale d and offset m (kind 6: a
 * scale per half of 16):
 *   kind 8: w = d * q, q int8                    (Q8_0)
 *   kind 4: w = d * q + m, q in 0..15 (4 bits)    (Q4_0: m = -8d; Q4_1; Q4_K's 32-value sub-blocks)
 *   kind 6: w = d_h * (q - 32), q in 0..63 (6 bits), d_h the scale of k's half h (Q6_K's 16-value sub-blocks)
 * Flags on a kind say how its scales are stored: HALF_SCALES (16): as float16 (where every scale and offset is
 * one exactly: Q8_0, Q4_0, Q4_1); SYMMETRIC (32, kind 4 only): m = -8d, not stored (Q4_0, GPTQ's zero point 8);
 * SUPER_SCALES (64, kinds 4 and 6: Q4_K, Q6_K, whose groups need K % 256 == 0): as the file holds them, 8-bit
 * multiples of float16 factors per super-block of 256 k: d = D * sc, m = -(Dmin * mn) (kind 4: sc, mn 0..63),
 * d_h = sc_h * D (kind 6: sc_h int8), each product exact in float32; GROUP_SCALES (128, kind 4: AWQ, GPTQ), a
 * float16 d and an integer zero point z (0..255) per scale group of 2^span groups (span: the kind's bits 8-11),
 * m = -(z * d), exact in float32 (z <= 16: 16 significant bits).
 * pack_weight lays a weight out once in records, one per (block of 16 columns, group of 32 k), front to back:
 *   codes: kind 8: [8 quads][16 columns][4 k] bytes holding q + 128 (512 bytes); kinds 4 and 6: [4][16][4] bytes
 *          whose low nibbles hold (the low 4 bits of) quad j and high nibbles quad j + 4 (256 bytes); kind 6
 *          then [2][16][4] bytes of q's top 2 bits: byte (i, c, at) holds quads i, i + 2, i + 4, i + 6 at bits
 *          0, 2, 4, 6 (128 bytes)
 *   scale vectors of 16 (float32, or float16 with HALF_SCALES): kind 8: d; kind 4: d, m (d alone if SYMMETRIC);
 *   kind 6: d_0, d_1; with SUPER_SCALES 16 bytes each of sc and mn (kind 4) or sc_0 and sc_1 (kind 6), and after
 *   a column block's records, per super-block: D[16] and Dmin[16] float16 (kind 4), D[16] (kind 6); with
 *   GROUP_SCALES none, and after the block's records, per scale group: d[16] float16 and z[16] bytes
 * so a record is 576 / 544 bytes (kind 8: 1.125 / 1.0625 bytes a weight, float32 / float16 scales), 384 / 320
 * (kind 4; 352 / 288 symmetric: down to Q4_0's 0.5625; 288 + 64 per 8 with super scales: 0.578, Q4_K's file
 * 0.5625; 256 + 48 per 2^span with group scales: 0.523 for AWQ's groups of 128, whose file takes 0.520) or 512 /
 * 448 (kind 6; 416 + 32 per 8 with super scales: 0.82, as Q6_K's file).
 * Kind 1 (mixed) is a fused linear whose shards have different kinds (Q4_K_M files: Q4_K q/k, Q6_K v): its
 * data starts with a table of 2 int64 per block of 16 columns (the byte offset of its first record in the
 * data, and its kind with flags), then each shard packed as above.
 *
 * Paths, by the build's -march (kernels/build.py):
 * - AVX-512 VNNI (Zen 4, Intel since Ice Lake): activations are quantized per row and group to int8
 *   (s = amax / 127, xq = round(x / s), as llama.cpp does), and one VPDPBUSD per quad adds 4 products of the
 *   unsigned codes (nibbles, or q + 128) and the signed xq into each of 16 column sums. Per group,
 *   y += s * (d * dot + m * sum(xq)) for kind 4; where the offset is a multiple of d (kind 8: -128d, taking back
 *   the 128 * sum(xq) that q + 128 adds; symmetric kind 4: -8d) the sum starts at that multiple of sum(xq)
 *   instead, exact in int32, and y += s * d * dot; kind 6 subtracts 32 sum(xq) of each half from its sum.
 * - AVX2 + FMA + F16C (the avx2 and avx512 levels: Zen 2/3, Skylake-X): the same activation codes and the same
 *   int32 sums, 8 columns at a time, through maddubs (unsigned x signed bytes into int16 pairs; kind 8's signed
 *   codes go in as |q| with xq carrying q's sign, so no pair saturates) and madd; then the same float
 *   operations per column as the VNNI path, so both give the same results bit for bit. Where the build has
 *   256-bit VNNI (AVX-VNNI: Alder Lake and later, Sierra Forest; or AVX512-VNNI + VL, whose EVEX form of the
 *   same instruction lets an AVX-512 machine test this path), one VPDPBUSD per quad replaces maddubs + madd +
 *   add, taking kind 8's stored q + 128 as the 512-bit path does.
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

/* 256-bit int8 dot products (VPDPBUSD on ymm) for the AVX2 path: AVX-VNNI's VEX form, or AVX512-VNNI's EVEX one
 * (AVX512VL), the same operation. */
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define DOT_VNNI_256 1
#else
#define DOT_VNNI_256 0
#endif
#define ROWS_PER_PASS 8

#define MIXED 1

#define HALF_SCALES 16
#define SYMMETRIC 32
#define SUPER_SCALES 64
#define SUPER_SHIFT 3 /* 2^3 groups of 32 per super-block */
#define GROUP_SCALES 128
#define SPAN_SHIFT 8 /* GROUP_SCALES: log2 of the groups per scale group, in bits 8-11 of the kind */

static inline int base_kind(int kind) { return kind & 15; }
static inline int scale_bytes(int kind) { return kind & HALF_SCALES ? 2 : 4; }
static inline int64_t code_bytes(int kind) { return base_kind(kind) == 8 ? 512 : base_kind(kind) == 6 ? 384 : 256; }
/* How many vectors of 16 scales a record holds. */
static inline int scale_vectors(int kind) {
    return base_kind(kind) == 8 || (kind & SYMMETRIC) ? 1 : 2;
}
static inline int64_t record_bytes(int kind) {
    if (kind & GROUP_SCALES) return code_bytes(kind);
    return code_bytes(kind) + (kind & SUPER_SCALES ? 2 * COLS : scale_vectors(kind) * COLS * scale_bytes(kind));
}
/* Scales kept after a column block's records, one set per 2^factor_shift groups (SUPER_SCALES: float16 factors
 * per super-block; GROUP_SCALES: d and z per scale group): their shift and bytes (0 without). */
static inline int factor_shift(int kind) {
    return kind & SUPER_SCALES ? SUPER_SHIFT : kind & GROUP_SCALES ? (kind >> SPAN_SHIFT) & 15 : 0;
}
static inline int64_t factor_bytes(int kind) {
    if (kind & GROUP_SCALES) return 3 * COLS;
    return kind & SUPER_SCALES ? (base_kind(kind) == 4 ? 2 : 1) * COLS * 2 : 0;
}
/* A column block's bytes: its records, then their factors. */
static inline int64_t block_bytes(int64_t groups, int kind) {
    return groups * record_bytes(kind) + (groups >> factor_shift(kind)) * factor_bytes(kind);
}
static inline int known_kind(int kind) {
    const int base = base_kind(kind);
    if (kind & SUPER_SCALES) return (kind == (4 | SUPER_SCALES) || kind == (6 | SUPER_SCALES));
    if (kind & GROUP_SCALES) return (kind & ~(15 << SPAN_SHIFT)) == (4 | GROUP_SCALES);
    return (base == 8 || base == 4 || base == 6) && !(kind & ~(15 | HALF_SCALES | SYMMETRIC))
           && (!(kind & SYMMETRIC) || base == 4);
}
static inline int takes_k(int64_t k, int kind) { return k % ((int64_t)GROUP << factor_shift(kind)) == 0; }

/* float16 bits -> float32 (exact). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t u;
    if (exponent == 0x1f)
        u = sign | 0x7f800000u | (mantissa << 13);
    else if (exponent)
        u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    else { /* zero or subnormal: mantissa * 2^-24 */
        const float f = (float)mantissa * 0x1p-24f;
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float f16_at(const uint8_t *p, int64_t i) {
    uint16_t h;
    memcpy(&h, p + 2 * i, sizeof h);
    return f16_to_f32(h);
}

/* Record g of a column block (recs: its first) and, with SUPER_SCALES or GROUP_SCALES, its factors. */
static inline const uint8_t *record_at(const uint8_t *recs, int64_t g, int kind) { return recs + g * record_bytes(kind); }
/* The first pass over a column block streams its records from memory; the hardware prefetcher alone leaves the
 * int8 paths waiting on them at 16 rows (memory time and compute time measured adding up), so each group asks
 * for the record PREFETCH_BYTES ahead (into the next block at the end), one cache line at a time. Not for a
 * single row, where the hardware prefetcher keeps up and the extra instructions cost (measured). */
#define PREFETCH_BYTES 4096
static inline void prefetch_ahead(const uint8_t *recs, int64_t g, int kind) {
    for (int64_t at = 0; at < record_bytes(kind); at += 64)
        __builtin_prefetch(record_at(recs, g, kind) + PREFETCH_BYTES + at, 0, 3);
}
static inline const uint8_t *factors_at(const uint8_t *recs, int64_t g, int64_t groups, int kind) {
    return recs + groups * record_bytes(kind) + (g >> factor_shift(kind)) * factor_bytes(kind);
}

/* Record g's scales as float32: sv[0] = d (kind 6: d_0), sv[1] = its aux: m, -8d (symmetric), -128d (kind 8),
 * or kind 6's d_1. */
static inline void record_scales(const uint8_t *recs, int64_t g, int64_t groups, int kind, float sv[2][COLS]) {
    const uint8_t *rec = record_at(recs, g, kind), *p = rec + code_bytes(kind);
    if (kind & GROUP_SCALES) { /* d, and m = -(z * d) */
        const uint8_t *f = factors_at(recs, g, groups, kind);
        for (int64_t c = 0; c < COLS; ++c) {
            sv[0][c] = f16_at(f, c);
            sv[1][c] = -((float)f[2 * COLS + c] * sv[0][c]);
        }
        return;
    }
    if (kind & SUPER_SCALES) {
        const uint8_t *f = factors_at(recs, g, groups, kind);
        for (int64_t c = 0; c < COLS; ++c) {
            if (base_kind(kind) == 4) {
                sv[0][c] = f16_at(f, c) * (float)p[c];
                sv[1][c] = -(f16_at(f, COLS + c) * (float)p[COLS + c]);
            } else {
                sv[0][c] = (float)(int8_t)p[c] * f16_at(f, c);
                sv[1][c] = (float)(int8_t)p[COLS + c] * f16_at(f, c);
            }
        }
        return;
    }
    for (int v = 0; v < scale_vectors(kind); ++v)
        for (int64_t c = 0; c < COLS; ++c) {
            const uint8_t *at = p + (v * COLS + c) * scale_bytes(kind);
            if (kind & HALF_SCALES) {
                uint16_t h;
                memcpy(&h, at, sizeof h);
                sv[v][c] = f16_to_f32(h);
            } else {
                memcpy(&sv[v][c], at, sizeof(float));
            }
        }
    if (scale_vectors(kind) == 1)
        for (int64_t c = 0; c < COLS; ++c) sv[1][c] = (base_kind(kind) == 8 ? -128.f : -8.f) * sv[0][c];
}

/* Column block nb's kind and first record: the weight's own kind and place, or a mixed weight's table's. */
static inline const uint8_t *block_records(const uint8_t *packed, int64_t nb, int64_t groups, int kind,
                                           int *block_kind) {
    if (kind != MIXED) {
        *block_kind = kind;
        return packed + nb * block_bytes(groups, kind);
    }
    const int64_t *table = (const int64_t *)packed;
    *block_kind = (int)table[2 * nb + 1];
    return packed + table[2 * nb];
}

/* Which path this build runs: 1 AVX-512 VNNI, 2 AVX2 int8 (maddubs), 3 AVX2 int8 with 256-bit VNNI (all three
 * quantize the activations), 0 float tiles. */
int int8_path(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return DOT_VNNI_256 ? 3 : 2;
#else
    return 0;
#endif
}

/* Bytes pack_weight writes for a [n, k] weight of this kind. */
int64_t packed_bytes(int64_t n, int64_t k, int kind) { return (n / COLS) * block_bytes(k / GROUP, kind); }

/* Group g of column c's codes q[32] into record rec (layout above). */
static inline void pack_codes(uint8_t *rec, const uint8_t *q, int64_t c, int base) {
    for (int64_t kk = 0; kk < GROUP; ++kk) {
        const int64_t quad = kk / 4, at = kk % 4;
        if (base == 8) {
            rec[(quad * COLS + c) * 4 + at] = (uint8_t)(q[kk] ^ 0x80u); /* q + 128, unsigned */
            continue;
        }
        rec[((quad % 4) * COLS + c) * 4 + at] |= (uint8_t)((q[kk] & 15) << (quad < 4 ? 0 : 4));
        if (base == 6) rec[256 + ((quad % 2) * COLS + c) * 4 + at] |= (uint8_t)(((q[kk] >> 4) & 3) << (2 * (quad / 2)));
    }
}

/* codes [n, k] (int8 for kind 8, 0..15 for kind 4, 0..63 for kind 6) and their scales -> records (layout above).
 * Scales: d [n, k / 32] (kind 6: [n, k / 16]) and m [n, k / 32] (kind 4 unless symmetric; else unread), float16
 * bits with HALF_SCALES, else float32. With SUPER_SCALES: d = D and m = Dmin [n, k / 256] float16 bits, sc and mn
 * [n, k / 32] uint8 (kind 4), or sc [n, k / 16] int8 (kind 6; mn unread). With GROUP_SCALES: d [n, k / (32 * 2^span)]
 * float16 bits and the zero points mn [n, k / (32 * 2^span)] uint8 (m, sc unread). */
int pack_weight(const uint8_t *codes, const void *d, const void *m, const uint8_t *sc, const uint8_t *mn,
                uint8_t *packed, int64_t n, int64_t k, int kind) {
    if (n % COLS || !takes_k(k, kind) || !known_kind(kind)) return 1;
    const int64_t groups = k / GROUP, sb = scale_bytes(kind), supers = groups >> factor_shift(kind);
    const int base = base_kind(kind), per = base == 6 ? 2 : 1; /* scales per group */
    memset(packed, 0, (size_t)packed_bytes(n, k, kind)); /* kinds 4 and 6 OR their bit fields in */
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < n / COLS; ++nb) {
        uint8_t *recs = packed + nb * block_bytes(groups, kind);
        for (int64_t g = 0; g < groups; ++g) {
            uint8_t *rec = recs + g * record_bytes(kind), *scales = rec + code_bytes(kind);
            for (int64_t c = 0; c < COLS; ++c) {
                const int64_t col = nb * COLS + c;
                pack_codes(rec, codes + col * k + g * GROUP, c, base);
                if (kind & GROUP_SCALES) { /* each scale group's d and z after the block's records */
                    uint8_t *f = (uint8_t *)factors_at(recs, g, groups, kind);
                    const int64_t at = col * supers + (g >> factor_shift(kind));
                    memcpy(f + 2 * c, (const uint8_t *)d + 2 * at, 2);
                    f[2 * COLS + c] = mn[at];
                    continue;
                }
                if (kind & SUPER_SCALES) { /* the 8-bit multiples here, the factors after the block's records */
                    scales[c] = sc[col * per * groups + per * g];
                    scales[COLS + c] = base == 6 ? sc[col * per * groups + per * g + 1] : mn[col * groups + g];
                    uint8_t *f = (uint8_t *)factors_at(recs, g, groups, kind);
                    memcpy(f + 2 * c, (const uint8_t *)d + 2 * (col * supers + (g >> SUPER_SHIFT)), 2);
                    if (base == 4) memcpy(f + 2 * (COLS + c), (const uint8_t *)m + 2 * (col * supers + (g >> SUPER_SHIFT)), 2);
                    continue;
                }
                /* scale vector v's column c <- element at[v] of d or m */
                const uint8_t *from[2] = {(const uint8_t *)d, (const uint8_t *)(base == 6 ? d : m)};
                const int64_t at[2] = {col * per * groups + per * g, col * per * groups + per * g + (base == 6)};
                for (int v = 0; v < scale_vectors(kind); ++v)
                    memcpy(scales + (v * COLS + c) * sb, from[v] + at[v] * sb, (size_t)sb);
            }
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

/* The weight of column c at k = kk of a record (sv: its record_scales), exactly as the float loader
 * dequantizes it: d * (q - 128) (kind 8), d * q + m (kind 4), (q - 32) * d_h (kind 6). */
static inline float weight_at(const uint8_t *rec, int kind, const float sv[2][COLS], int64_t kk, int64_t c) {
    const int64_t quad = kk / 4, at = kk % 4;
    if (base_kind(kind) == 8) return sv[0][c] * (float)((int)rec[(quad * COLS + c) * 4 + at] - 128);
    const uint8_t byte = rec[((quad % 4) * COLS + c) * 4 + at];
    const int low = quad < 4 ? byte & 15 : byte >> 4;
    if (base_kind(kind) == 4) return sv[0][c] * (float)low + sv[1][c];
    const int top = (rec[256 + ((quad % 2) * COLS + c) * 4 + at] >> (2 * (quad / 2))) & 3;
    return (float)(low + 16 * top - 32) * sv[kk / 16][c];
}

/* Rows ids[i] of a packed [n, k] weight used as a table (token embeddings: row = output column) dequantized
 * into out[count][k], float32 or bf16 (rounded from the float32 weight, as copying the dequantized table into
 * a bf16 parameter rounds it). */
int dequantize_rows(const uint8_t *packed, const int64_t *ids, int64_t count, void *out, int64_t n, int64_t k,
                    int kind, int bf16, int threads) {
    if (n % COLS || k % GROUP || !(known_kind(kind) || kind == MIXED)) return 1;
    for (int64_t i = 0; i < count; ++i)
        if (ids[i] < 0 || ids[i] >= n) return 3;
    const int64_t groups = k / GROUP;
#pragma omp parallel for num_threads(count * k >= 65536 ? threads : 1) schedule(static)
    for (int64_t i = 0; i < count; ++i) {
        int block_kind;
        const uint8_t *recs = block_records(packed, ids[i] / COLS, groups, kind, &block_kind);
        const int64_t c = ids[i] % COLS;
        for (int64_t g = 0; g < groups; ++g) {
            const uint8_t *rec = record_at(recs, g, block_kind);
            float sv[2][COLS];
            record_scales(recs, g, groups, block_kind, sv);
            for (int64_t kk = 0; kk < GROUP; ++kk) {
                const float w = weight_at(rec, block_kind, sv, kk, c);
                const int64_t at = i * k + g * GROUP + kk;
                if (bf16)
                    ((uint16_t *)out)[at] = f32_to_bf16(w);
                else
                    ((float *)out)[at] = w;
            }
        }
    }
    return 0;
}

/* x [m, k] (bf16 or f32) with its columns in `order` (GPTQ act-order: the order of the weight's inputs) into a
 * new array, x[r][order[i]] at [r][i]; NULL when out of memory. */
static void *gather_columns(const void *x, const int64_t *order, int64_t m, int64_t k, int bf16, int threads) {
    const size_t size = bf16 ? 2 : 4;
    uint8_t *out = malloc(size * (size_t)(m * k));
    if (!out) return NULL;
#pragma omp parallel for num_threads(m * k >= 65536 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < m; ++r)
        for (int64_t i = 0; i < k; ++i) {
            if (bf16)
                ((uint16_t *)out)[r * k + i] = ((const uint16_t *)x)[r * k + order[i]];
            else
                ((float *)out)[r * k + i] = ((const float *)x)[r * k + order[i]];
        }
    return out;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

/* Values at..at + 15 of a bf16 or f32 array as float32 (bf16 -> f32 exact). */
static inline __m512 load_f32x16(const void *x, int64_t at, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)x + at);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* x rows -> int8 codes [m][k], scales [m][k / 32] and code sums [m][k / 16] (per row and half group: kind 6's
 * halves have their own scales; the others add the two), a group of 32 in two vectors: s = amax / 127 and
 * xq = round-half-even(x / s), exactly as a scalar loop would (IEEE division, the same rounding). A group
 * holding a NaN or an infinity gets a NaN scale (its codes 0), so that the outputs it feeds are NaN, as
 * the float path's would be; an all-zero group scale 0 and codes 0. */
static void quantize_rows(const void *x, int64_t m, int64_t k, int bf16, int8_t *xq, float *xs, int32_t *xsum,
                          int threads) {
    const int64_t groups = k / GROUP;
#pragma omp parallel for num_threads(m * k >= 65536 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < m; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t at = r * k + g * GROUP;
            const __m512 v[2] = {load_f32x16(x, at, bf16), load_f32x16(x, at + 16, bf16)};
            const __m512 a0 = _mm512_abs_ps(v[0]), a1 = _mm512_abs_ps(v[1]), inf = _mm512_set1_ps(INFINITY);
            const int finite = (_mm512_cmp_ps_mask(a0, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(a1, inf, _CMP_LT_OQ))
                               == 0xFFFF;
            const float s = finite ? _mm512_reduce_max_ps(_mm512_max_ps(a0, a1)) / 127.f : NAN;
            int32_t *sums = xsum + r * 2 * groups + 2 * g;
            xs[r * groups + g] = s;
            if (!(s > 0.f)) { /* zeros, or not finite */
                memset(xq + at, 0, GROUP);
                sums[0] = sums[1] = 0;
                continue;
            }
            for (int h = 0; h < 2; ++h) {
                const __m512 scaled = _mm512_div_ps(v[h], _mm512_set1_ps(s));
                const __m512i q = _mm512_cvtps_epi32(_mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT
                                                                                  | _MM_FROUND_NO_EXC));
                _mm_storeu_si128((__m128i *)(xq + at + 16 * h), _mm512_cvtepi32_epi8(q));
                sums[h] = _mm512_reduce_add_epi32(q);
            }
        }
}

/* The 8 code vectors of a record: quad j's 4 k of each of the 16 columns, as unsigned bytes. */
static inline __attribute__((always_inline)) void record_codes(const uint8_t *rec, const int kind, __m512i w[8]) {
    const __m512i low = _mm512_set1_epi8(0x0f), two = _mm512_set1_epi8(0x03);
    if (base_kind(kind) == 8) {
        for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(rec + 64 * j);
        return;
    }
    for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(rec + 64 * j);
        w[j] = _mm512_and_si512(v, low);
        w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    if (base_kind(kind) == 6) { /* quad j's top 2 bits sit at bit 2 * (j / 2) of h[j % 2]: moved to bits 4-5 */
        const __m512i h[2] = {_mm512_loadu_si512(rec + 256), _mm512_loadu_si512(rec + 320)};
        for (int j = 0; j < 8; ++j)
            w[j] = _mm512_or_si512(w[j], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h[j % 2], 2 * (j / 2)),
                                                                            two), 4));
    }
}

static inline __attribute__((always_inline)) __m512 f16_vector(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* Record g's two scale vectors as float32, as record_scales gives them: sv[0] = d (kind 6: d_0), sv[1] = aux
 * (kind 6: d_1). */
static inline __attribute__((always_inline)) void scale_vectors_of(const uint8_t *recs, int64_t g, int64_t groups,
                                                                  const int kind, __m512 sv[2]) {
    const uint8_t *p = record_at(recs, g, kind) + code_bytes(kind);
    if (kind & GROUP_SCALES) { /* d, and m = -(z * d) */
        const uint8_t *f = factors_at(recs, g, groups, kind);
        sv[0] = f16_vector(f);
        const __m512 zd = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(f + 2 * COLS)))), sv[0]);
        sv[1] = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(zd), _mm512_set1_epi32(INT32_MIN)));
        return;
    }
    if (kind & SUPER_SCALES) {
        const uint8_t *f = factors_at(recs, g, groups, kind);
        const __m128i lo = _mm_loadu_si128((const __m128i *)p), hi = _mm_loadu_si128((const __m128i *)(p + COLS));
        if (base_kind(kind) == 4) { /* d = D * sc, m = -(Dmin * mn) */
            sv[0] = _mm512_mul_ps(f16_vector(f), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)));
            const __m512 dm = _mm512_mul_ps(f16_vector(f + 2 * COLS), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)));
            sv[1] = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dm), _mm512_set1_epi32(INT32_MIN)));
        } else { /* d_h = sc_h * D */
            const __m512 d = f16_vector(f);
            sv[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), d);
            sv[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), d);
        }
        return;
    }
    for (int v = 0; v < scale_vectors(kind); ++v)
        sv[v] = kind & HALF_SCALES ? f16_vector(p + v * COLS * 2) : _mm512_loadu_ps((const float *)p + v * COLS);
    if (scale_vectors(kind) == 1) sv[1] = _mm512_mul_ps(sv[0], _mm512_set1_ps(base_kind(kind) == 8 ? -128.f : -8.f));
}

/* Rows [r0, r0 + rows) of column block nb (records from `recs`). Per group, each code vector is used by every
 * row (the rows' int32 sums are independent chains, interleaved), and each row's quad of xq is a broadcast
 * operand. Kind 6 sums each half of the group apart (its halves have their own scales), in the same registers. */
static inline __attribute__((always_inline)) void block_vnni(const int8_t *xq, const float *xs, const int32_t *xsum,
                                                            const uint8_t *recs, const void *bias, void *y,
                                                            int64_t r0, int64_t rows, int64_t nb, int64_t n,
                                                            int64_t k, const int kind, int bf16) {
    const int64_t groups = k / GROUP;
    const int passes = base_kind(kind) == 6 ? 2 : 1, quads = 8 / passes;
    __m512 f[ROWS_PER_PASS];
    for (int64_t r = 0; r < ROWS_PER_PASS; ++r) f[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512i w[8];
        __m512 sv[2];
        if (r0 == 0 && rows > 1) prefetch_ahead(recs, g, kind);
        record_codes(record_at(recs, g, kind), kind, w);
        scale_vectors_of(recs, g, groups, kind, sv);
        for (int half = 0; half < passes; ++half) {
            /* Where the offset is a multiple of d (kind 8: -128d, undoing the + 128 of its codes; symmetric kind
             * 4: -8d) each sum starts at that multiple of sum(xq), so that one scale pass finishes it: exact in
             * int32 (measured 3-10% faster at 16-256 rows than a second pass; for kind 6 the start values cost
             * more than its per-half subtraction saves). */
            __m512i acc[ROWS_PER_PASS];
            for (int64_t r = 0; r < ROWS_PER_PASS; ++r) {
                const int32_t *sums = xsum + (r0 + (r < rows ? r : 0)) * 2 * groups + 2 * g;
                acc[r] = _mm512_set1_epi32(base_kind(kind) == 8 ? -128 * (sums[0] + sums[1])
                                           : kind & SYMMETRIC ? -8 * (sums[0] + sums[1]) : 0);
            }
            for (int j = half * quads; j < (half + 1) * quads; ++j)
                for (int64_t r = 0; r < rows; ++r) {
                    int32_t quad;
                    memcpy(&quad, xq + (r0 + r) * k + g * GROUP + 4 * j, sizeof quad);
                    acc[r] = _mm512_dpbusd_epi32(acc[r], w[j], _mm512_set1_epi32(quad));
                }
            const __m512 dv = sv[half];
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t row = r0 + r;
                const float s = xs[row * groups + g];
                const int32_t *sums = xsum + row * 2 * groups + 2 * g;
                if (base_kind(kind) == 6) { /* sum (q - 32) xq = dot - 32 sum(xq), exact in int32 */
                    const __m512i dot = _mm512_sub_epi32(acc[r], _mm512_set1_epi32(32 * sums[half]));
                    f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv, _mm512_set1_ps(s)), f[r]);
                    continue;
                }
                f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(dv, _mm512_set1_ps(s)), f[r]);
                if (base_kind(kind) == 4 && !(kind & SYMMETRIC)) /* m is its own: + m s sum(xq) */
                    f[r] = _mm512_fmadd_ps(sv[1], _mm512_set1_ps(s * (float)(sums[0] + sums[1])), f[r]);
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        float sums[COLS];
        _mm512_storeu_ps(sums, f[r]);
        store_block_row(y, sums, bias, r0 + r, nb, n, bf16);
    }
}

#define INT8_ROWS ROWS_PER_PASS
#define INT8_BLOCK block_vnni

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#define AVX2_ROWS 4 /* rows per pass: 16 ymm registers hold their sums, a code vector and temporaries */

/* Values at..at + 7 of a bf16 or f32 array as float32. */
static inline __m256 load_f32x8(const void *x, int64_t at, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)x + at);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float max_of(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline int32_t sum_of(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

/* As the AVX-512 quantize_rows (the same s, codes and sums bit for bit), a group in four vectors of 8. */
static void quantize_rows(const void *x, int64_t m, int64_t k, int bf16, int8_t *xq, float *xs, int32_t *xsum,
                          int threads) {
    const int64_t groups = k / GROUP;
    const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(INFINITY);
#pragma omp parallel for num_threads(m * k >= 65536 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < m; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t at = r * k + g * GROUP;
            __m256 v[4], amax = _mm256_setzero_ps();
            int finite = 1;
            for (int i = 0; i < 4; ++i) {
                v[i] = load_f32x8(x, at + 8 * i, bf16);
                const __m256 a = _mm256_andnot_ps(sign, v[i]);
                finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_LT_OQ)) == 0xff;
                amax = _mm256_max_ps(amax, a);
            }
            const float s = finite ? max_of(amax) / 127.f : NAN;
            int32_t *sums = xsum + r * 2 * groups + 2 * g;
            xs[r * groups + g] = s;
            sums[0] = sums[1] = 0;
            if (!(s > 0.f)) { /* zeros, or not finite */
                memset(xq + at, 0, GROUP);
                continue;
            }
            __m256i q[4];
            for (int i = 0; i < 4; ++i) {
                q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(v[i], _mm256_set1_ps(s)),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                sums[i / 2] += sum_of(q[i]);
            }
            /* int32 -> int8 in order: the packs work per 128-bit lane, so put the lanes back after */
            const __m256i w16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(xq + at), _mm256_permutevar8x32_epi32(w16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
}

/* Quad j's codes of the 8 columns of half ch of a record (32 bytes: 4 k per column): unsigned for kinds 4 and
 * 6; for kind 8 signed q for maddubs (its stored q + 128 with the top bit flipped back), the stored q + 128 for
 * VPDPBUSD. */
static inline __attribute__((always_inline)) __m256i half_quad_codes(const uint8_t *rec, const int kind, int j, int ch) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    if (base_kind(kind) == 8) {
        const __m256i stored = _mm256_loadu_si256((const __m256i *)(rec + 64 * j + 32 * ch));
        return DOT_VNNI_256 ? stored : _mm256_xor_si256(stored, _mm256_set1_epi8((char)0x80));
    }
    const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 64 * (j % 4) + 32 * ch));
    __m256i w = _mm256_and_si256(j < 4 ? v : _mm256_srli_epi16(v, 4), low);
    if (base_kind(kind) == 6) { /* quad j's top 2 bits sit at bit 2 * (j / 2) of the high-bit bytes j % 2 */
        const __m256i h = _mm256_loadu_si256((const __m256i *)(rec + 256 + 64 * (j % 2) + 32 * ch));
        w = _mm256_or_si256(w, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * (j / 2)), _mm256_set1_epi8(3)), 4));
    }
    return w;
}

static inline __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* Record g's scales for the 8 columns of half ch, as record_scales gives them (the same float operations). */
static inline __attribute__((always_inline)) void half_scales_of(const uint8_t *recs, int64_t g, int64_t groups,
                                                                const int kind, int ch, __m256 sv[2]) {
    const uint8_t *p = record_at(recs, g, kind) + code_bytes(kind);
    if (kind & GROUP_SCALES) { /* d, and m = -(z * d) */
        const uint8_t *f = factors_at(recs, g, groups, kind);
        sv[0] = f16x8(f + 16 * ch);
        const __m128i z = _mm_loadl_epi64((const __m128i *)(f + 2 * COLS + 8 * ch));
        sv[1] = _mm256_xor_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(z)), sv[0]), _mm256_set1_ps(-0.f));
        return;
    }
    if (kind & SUPER_SCALES) {
        const uint8_t *f = factors_at(recs, g, groups, kind);
        const __m128i lo = _mm_loadl_epi64((const __m128i *)(p + 8 * ch));
        const __m128i hi = _mm_loadl_epi64((const __m128i *)(p + COLS + 8 * ch));
        const __m256 d = f16x8(f + 16 * ch);
        if (base_kind(kind) == 4) { /* d = D * sc, m = -(Dmin * mn) */
            sv[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
            const __m256 dm = _mm256_mul_ps(f16x8(f + 2 * COLS + 16 * ch), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
            sv[1] = _mm256_xor_ps(dm, _mm256_set1_ps(-0.f));
        } else { /* d_h = sc_h * D */
            sv[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), d);
            sv[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), d);
        }
        return;
    }
    for (int v = 0; v < scale_vectors(kind); ++v)
        sv[v] = kind & HALF_SCALES ? f16x8(p + (v * COLS + 8 * ch) * 2) : _mm256_loadu_ps((const float *)p + v * COLS + 8 * ch);
    if (scale_vectors(kind) == 1) sv[1] = _mm256_mul_ps(sv[0], _mm256_set1_ps(base_kind(kind) == 8 ? -128.f : -8.f));
}

/* acc plus, per column, the sum of its 4 codes times the 4 activation codes in xq4 (every dword the same 4
 * bytes), exact in int32. VPDPBUSD takes the unsigned codes as they are (kind 8's q + 128: its sum starts at
 * -128 sum(xq)); maddubs takes unsigned x signed bytes into saturating int16 pairs, so kind 8's signed codes go
 * in as |q| with xq carrying q's sign (no pair reaches 2^15); nibbles and 6-bit codes are unsigned already. */
static inline __attribute__((always_inline)) __m256i dot_quads(__m256i acc, __m256i w, __m256i xq4, const int kind) {
#if DOT_VNNI_256 && defined(__AVXVNNI__)
    (void)kind;
    return _mm256_dpbusd_avx_epi32(acc, w, xq4);
#elif DOT_VNNI_256
    (void)kind;
    return _mm256_dpbusd_epi32(acc, w, xq4);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (base_kind(kind) == 8)
        return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xq4, w)), ones));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, xq4), ones));
#endif
}

/* Row `row`'s quad j of group g of the activation codes, in every dword of a vector. */
static inline __attribute__((always_inline)) __m256i xq_quad(const int8_t *xq, int64_t row, int64_t k, int64_t g,
                                                            int j) {
    int32_t quad;
    memcpy(&quad, xq + row * k + g * GROUP + 4 * j, sizeof quad);
    return _mm256_set1_epi32(quad);
}

/* With maddubs, how many quads' products a column's int16 lanes sum before madd widens them: each lane gets one
 * pair of products per quad, at most 2 * 15 * 127 for nibbles, so a group's 8 quads (30480 < 2^15) stay exact and
 * madd + add run once a group instead of once a quad (Zen 4, avx2 level: Q4_0 / Q4_1 matmuls 1.06-1.16x at 16-256
 * rows). 6-bit codes could take 2 quads (2 * 2 * 63 * 127 = 32004) but measured 0.94x, and kind 8's |q| up to
 * 128 fills a lane in one quad; VPDPBUSD sums in int32 directly. */
#define INT16_QUADS(kind) (DOT_VNNI_256 ? 1 : base_kind(kind) == 4 ? 8 : 1)

/* acc[r] += the int32 sums of quads j0 .. j0 + INT16_QUADS(kind) for rows r0 .. r0 + rows, summed in int16 first. */
static inline __attribute__((always_inline)) void int16_quads(const int8_t *xq, const uint8_t *rec, const int kind,
                                                             int ch, int j0, int64_t r0, int64_t rows, int64_t k,
                                                             int64_t g, __m256i acc[AVX2_ROWS]) {
    __m256i lanes[AVX2_ROWS];
    for (int64_t r = 0; r < rows; ++r) lanes[r] = _mm256_setzero_si256();
    for (int j = j0; j < j0 + INT16_QUADS(kind); ++j) {
        const __m256i w = half_quad_codes(rec, kind, j, ch);
        for (int64_t r = 0; r < rows; ++r)
            lanes[r] = _mm256_add_epi16(lanes[r], _mm256_maddubs_epi16(w, xq_quad(xq, r0 + r, k, g, j)));
    }
    for (int64_t r = 0; r < rows; ++r) acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(lanes[r], _mm256_set1_epi16(1)));
}

/* Rows [r0, r0 + rows) of column block nb, 8 columns at a time; the same int32 sums as the VNNI path, then the
 * same float operations per column (with maddubs kind 8 sums q xq directly, so its offset term is 0 here). */
static inline __attribute__((always_inline)) void block_avx2(const int8_t *xq, const float *xs, const int32_t *xsum,
                                                            const uint8_t *recs, const void *bias, void *y,
                                                            int64_t r0, int64_t rows, int64_t nb, int64_t n,
                                                            int64_t k, const int kind, int bf16) {
    const int64_t groups = k / GROUP;
    const int passes = base_kind(kind) == 6 ? 2 : 1, quads = 8 / passes;
    float out[AVX2_ROWS][COLS];
    for (int ch = 0; ch < 2; ++ch) {
        __m256 f[AVX2_ROWS];
        for (int64_t r = 0; r < AVX2_ROWS; ++r) f[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {
            const uint8_t *rec = record_at(recs, g, kind);
            if (ch == 0 && r0 == 0 && rows > 1) prefetch_ahead(recs, g, kind);
            __m256 sv[2];
            half_scales_of(recs, g, groups, kind, ch, sv);
            for (int half = 0; half < passes; ++half) {
                __m256i acc[AVX2_ROWS];
                for (int64_t r = 0; r < AVX2_ROWS; ++r) {
                    const int32_t *sums = xsum + (r0 + (r < rows ? r : 0)) * 2 * groups + 2 * g;
                    acc[r] = _mm256_set1_epi32(base_kind(kind) == 6 ? -32 * sums[half]
                                               : kind & SYMMETRIC ? -8 * (sums[0] + sums[1])
                                               : base_kind(kind) == 8 && DOT_VNNI_256 ? -128 * (sums[0] + sums[1]) : 0);
                }
                if (INT16_QUADS(kind) > 1)
                    for (int j0 = half * quads; j0 < (half + 1) * quads; j0 += INT16_QUADS(kind))
                        int16_quads(xq, rec, kind, ch, j0, r0, rows, k, g, acc);
                else
                    for (int j = half * quads; j < (half + 1) * quads; ++j) {
                        const __m256i w = half_quad_codes(rec, kind, j, ch);
                        for (int64_t r = 0; r < rows; ++r)
                            acc[r] = dot_quads(acc[r], w, xq_quad(xq, r0 + r, k, g, j), kind);
                    }
                const __m256 dv = sv[half];
                for (int64_t r = 0; r < rows; ++r) {
                    const int64_t row = r0 + r;
                    const float s = xs[row * groups + g];
                    f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_mul_ps(dv, _mm256_set1_ps(s)), f[r]);
                    if (base_kind(kind) == 4 && !(kind & SYMMETRIC)) { /* m is its own: + m s sum(xq) */
                        const int32_t *sums = xsum + row * 2 * groups + 2 * g;
                        f[r] = _mm256_fmadd_ps(sv[1], _mm256_set1_ps(s * (float)(sums[0] + sums[1])), f[r]);
                    }
                }
            }
        }
        for (int64_t r = 0; r < rows; ++r) _mm256_storeu_ps(out[r] + 8 * ch, f[r]);
    }
    for (int64_t r = 0; r < rows; ++r) store_block_row(y, out[r], bias, r0 + r, nb, n, bf16);
}

#define INT8_ROWS AVX2_ROWS
#define INT8_BLOCK block_avx2
#endif

#if defined(INT8_BLOCK)
/* A full pass (and a single row) takes a literal row count, so that its loops unroll and the per-row sums stay in
 * registers. */
#define BLOCK_CALL(KIND)                                                                                  \
    do {                                                                                                  \
        if (rows == INT8_ROWS)                                                                            \
            INT8_BLOCK(xq, xs, xsum, recs, bias, y, r0, INT8_ROWS, nb, n, k, KIND, bf16);                 \
        else if (rows == 1) /* single-stream decode */                                                    \
            INT8_BLOCK(xq, xs, xsum, recs, bias, y, r0, 1, nb, n, k, KIND, bf16);                         \
        else                                                                                              \
            INT8_BLOCK(xq, xs, xsum, recs, bias, y, r0, rows, nb, n, k, KIND, bf16);                      \
    } while (0)

static int gemm(const void *x, const uint8_t *packed, const void *bias, void *y, int64_t m, int64_t n, int64_t k,
               int kind, int bf16, int threads) {
    int8_t *xq = malloc((size_t)(m * k));
    float *xs = malloc(sizeof(float) * (size_t)(m * (k / GROUP)));
    int32_t *xsum = malloc(sizeof(int32_t) * (size_t)(m * (k / 16)));
    if (!xq || !xs || !xsum) {
        free(xq), free(xs), free(xsum);
        return 2;
    }
    quantize_rows(x, m, k, bf16, xq, xs, xsum, threads);
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int64_t nb = 0; nb < n / COLS; ++nb)
        for (int64_t r0 = 0; r0 < m; r0 += INT8_ROWS) {
            const int64_t rows = m - r0 < INT8_ROWS ? m - r0 : INT8_ROWS;
            int block_kind;
            const uint8_t *recs = block_records(packed, nb, k / GROUP, kind, &block_kind);
            switch (block_kind & 255) { /* each kind and flags a specialized copy (the span stays a variable) */
            case 8: BLOCK_CALL(8); break;
            case 8 | HALF_SCALES: BLOCK_CALL(8 | HALF_SCALES); break;
            case 6: BLOCK_CALL(6); break;
            case 6 | HALF_SCALES: BLOCK_CALL(6 | HALF_SCALES); break;
            case 6 | SUPER_SCALES: BLOCK_CALL(6 | SUPER_SCALES); break;
            case 4: BLOCK_CALL(4); break;
            case 4 | HALF_SCALES: BLOCK_CALL(4 | HALF_SCALES); break;
            case 4 | SYMMETRIC: BLOCK_CALL(4 | SYMMETRIC); break;
            case 4 | SUPER_SCALES: BLOCK_CALL(4 | SUPER_SCALES); break;
            case 4 | GROUP_SCALES: BLOCK_CALL((4 | GROUP_SCALES) | (block_kind & ~255)); break;
            default: BLOCK_CALL(4 | SYMMETRIC | HALF_SCALES); break;
            }
        }
    free(xq), free(xs), free(xsum);
    return 0;
}

#else /* dequantize each record into a float tile */

/* Record g of a column block as tile[kk][c] = the weight of the block's column c at k = g * 32 + kk. */
static inline void record_to_tile(const uint8_t *recs, int64_t g, int64_t groups, int kind, float tile[GROUP][COLS]) {
    float sv[2][COLS];
    record_scales(recs, g, groups, kind, sv);
    const uint8_t *rec = record_at(recs, g, kind);
    for (int64_t kk = 0; kk < GROUP; ++kk)
        for (int64_t c = 0; c < COLS; ++c) tile[kk][c] = weight_at(rec, kind, sv, kk, c);
}

static int gemm(const void *x, const uint8_t *packed, const void *bias, void *y, int64_t m, int64_t n, int64_t k,
               int kind, int bf16, int threads) {
    float *xf = malloc(sizeof(float) * (size_t)(m * k));
    if (!xf) return 2;
    for (int64_t i = 0; i < m * k; ++i) xf[i] = value_at(x, i, bf16);
    const int64_t groups = k / GROUP;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int64_t nb = 0; nb < n / COLS; ++nb)
        for (int64_t r0 = 0; r0 < m; r0 += ROWS_PER_PASS) {
            const int64_t rows = m - r0 < ROWS_PER_PASS ? m - r0 : ROWS_PER_PASS;
            float acc[ROWS_PER_PASS][COLS] = {{0.f}}, tile[GROUP][COLS];
            int block_kind;
            const uint8_t *recs = block_records(packed, nb, groups, kind, &block_kind);
            for (int64_t g = 0; g < groups; ++g) {
                record_to_tile(recs, g, groups, block_kind, tile);
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

/* y [m, n] = x [m, k] . w^T (+ bias), w packed by pack_weight; x, bias and y bf16 (bf16 = 1) or float32. With
 * `order` (NULL: none), x's columns are taken in that order first (GPTQ act-order weights). Status: 0 ok, 1 a
 * shape or kind it cannot take, 2 out of memory. */
int quant_gemm(const void *x, const uint8_t *packed, const void *bias, void *y, int64_t m, int64_t n, int64_t k,
               int kind, int bf16, int threads, const int64_t *order) {
    if (n % COLS || k % GROUP || !(known_kind(kind) || kind == MIXED)) return 1;
    if (!order) return gemm(x, packed, bias, y, m, n, k, kind, bf16, threads);
    void *gathered = gather_columns(x, order, m, k, bf16, threads);
    if (!gathered) return 2;
    const int status = gemm(gathered, packed, bias, y, m, n, k, kind, bf16, threads);
    free(gathered);
    return status;
}
