/* bfloat16 matmul for few rows (small decode batches): y[M, N] = x[M, K] . w[N, K]^T (+ bias), fp32 sums;
 * skinny_gemm_accumulate adds the product into y instead (y = y + x . w^T, rounded once: LoRA deltas).
 *
 * With few rows, the BLAS path spends its time re-laying out the weights on every call (bf16 dot-product
 * instructions need pairs of k values side by side), and runs far below peak. Here the weights are laid out
 * once, at load time, in blocks of 16 output columns, and a step streams them once, front to back; every
 * load is used by all rows and there are no horizontal sums. Two paths, chosen by the build's -march
 * (kernels/build.py); pack_weight is in the same library, so each library packs for its own path:
 *
 * - AVX-512 BF16: [N / 16][K / 2][16][2]. For a block, one 64-byte vector per pair of k holds that pair for
 *   all 16 columns; per vector, one BF16 dot product per input row adds 2 products into each of the row's
 *   16 column sums (the row's k pair is broadcast).
 * - AVX2 + FMA (also AVX-512 without BF16): [N / 16][K][8][2], where [nb][k][i][j] is column nb * 16 + 8j + i.
 *   One 32-byte load per k holds that k for the block's 16 columns; a shift and a mask widen it exactly to
 *   two fp32 vectors (columns 0-7 and 8-15), which one FMA each adds, times the row's x[k] broadcast in fp32,
 *   into the row's two column sums. Sums are rounded to bf16 to nearest even, as torch rounds.
 *
 * Each output is one fp32 lane summed in k order, whatever M is: a row's result does not depend on the batch.
 * Without AVX2 there is no path: available() is 0 and the layers use torch.
 *
 * Plain C with OpenMP, called through ctypes (pagedserve/kernels/skinny_gemm.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "swiglu.h"

enum { EPILOGUE_PLAIN, EPILOGUE_ACCUMULATE, EPILOGUE_SWIGLU };

#if defined(__AVX512BF16__)
#define LAYOUT 1         /* [N / 16][K / 2][16][2] */
#define ROWS_PER_PASS 12 /* rows per pass over BLOCKS_PER_PASS column blocks: 24 accumulators in registers */
#define BLOCKS_PER_PASS 2
#elif defined(__AVX2__) && defined(__FMA__)
#define LAYOUT 2       /* [N / 16][K][8][2] */
#define ROWS_PER_PASS 6 /* 2 accumulators a row: 12 of the 16 vector registers */
#define BLOCKS_PER_PASS 1
#else
#define LAYOUT 0
#endif

int available(void) { return LAYOUT != 0; }

/* Which packed layout pack_weight writes (the numbers above; 0: none). */
int packed_layout(void) { return LAYOUT; }

/* Column block nb (columns nb * 16 ...) of w [N, K] into its place in packed, in this build's layout. */
static void pack_block(const uint16_t *w, uint16_t *packed, int64_t nb, int64_t k) {
    const uint16_t *src = w + nb * 16 * k;
    uint16_t *dst = packed + nb * 16 * k;
#if LAYOUT == 1 /* [k pair p][column i][2] */
    for (int64_t p = 0; p < k / 2; ++p)
        for (int64_t i = 0; i < 16; ++i)
            for (int64_t j = 0; j < 2; ++j) dst[(p * 16 + i) * 2 + j] = src[i * k + 2 * p + j];
#else /* [k][i][j]: column 8j + i */
    for (int64_t kk = 0; kk < k; ++kk)
        for (int64_t i = 0; i < 8; ++i)
            for (int64_t j = 0; j < 2; ++j) dst[(kk * 8 + i) * 2 + j] = src[(8 * j + i) * k + kk];
#endif
}

/* w [N, K] bf16 -> packed (layout above). Requires N % 16 == 0 and K % 2 == 0. */
int pack_weight(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k) {
    if (n % 16 || k % 2 || LAYOUT == 0) return 1;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < n / 16; ++nb) pack_block(w, packed, nb, k);
    return 0;
}

/* Rows ids[i] of a packed [n, k] weight used as a table (a tied LM head's token embeddings) into out[count][k]:
 * the bf16 values exactly. Status: 0 ok, 1 bad shape or no layout, 3 an id outside 0..n-1. */
int packed_rows(const uint16_t *packed, const int64_t *ids, int64_t count, uint16_t *out, int64_t n, int64_t k) {
    if (n % 16 || k % 2 || LAYOUT == 0) return 1;
    for (int64_t i = 0; i < count; ++i)
        if (ids[i] < 0 || ids[i] >= n) return 3;
    for (int64_t i = 0; i < count; ++i) {
        const int64_t c = ids[i] % 16;
        const uint16_t *block = packed + (ids[i] / 16) * 16 * k;
        for (int64_t kk = 0; kk < k; ++kk)
#if LAYOUT == 1
            out[i * k + kk] = block[((kk / 2) * 16 + c) * 2 + kk % 2];
#else
            out[i * k + kk] = block[(kk * 8 + c % 8) * 2 + c / 8];
#endif
    }
    return 0;
}

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* 16 float32 -> 16 bf16, round to nearest even (as torch rounds). */
static inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

/* 16 bf16 -> 16 float32 (exact). */
static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Rows [m0, m0 + rows) of y for the `blocks` (1 or 2) column blocks from nb; rows <= ROWS_PER_PASS. xp: row m0's
 * first k pair; row r's pair p is xp[r * row_stride + p * pair_stride] (x as it is: k / 2 and 1; a panel: 1 and
 * ROWS_PER_PASS). Each
 * broadcast pair of x feeds both blocks and each weight vector every row: per pair of k, 2 weight loads and
 * `rows` broadcasts for 2 * rows dot products (one block of 16 rows took 17 loads for 16). Modes (EPILOGUE_*):
 * plain (+ bias), accumulate (y's values added to the sums before the one rounding), or SwiGLU: the two blocks
 * are gate block nb and up block nb of a fused gate/up weight, half the blocks apart (n / 16 of them: y is
 * [M, n], the activation), and each pair of rounded sums becomes round(round(silu(g)) * u), as fused_ops.c's
 * swiglu computes it from the stored projection. */
static inline __attribute__((always_inline)) void column_blocks(const uint32_t *xp, int64_t row_stride,
                                                               int64_t pair_stride, const uint16_t *packed,
                                                               const uint16_t *bias, uint16_t *y, int64_t m0,
                                                               int64_t rows, int64_t nb, int blocks, int64_t n,
                                                               int64_t k, int mode) {
    __m512 acc[BLOCKS_PER_PASS][ROWS_PER_PASS];
    for (int b = 0; b < blocks; ++b)
        for (int64_t r = 0; r < rows; ++r) acc[b][r] = _mm512_setzero_ps();
    const __m512i *wp = (const __m512i *)(packed + nb * (k / 2) * 32);
    const int64_t gap = mode == EPILOGUE_SWIGLU ? (n / 16) * (k / 2) : k / 2; /* vectors from block 0 to 1 */
    for (int64_t p = 0; p < k / 2; ++p) {
        __m512bh wv[BLOCKS_PER_PASS];
        for (int b = 0; b < blocks; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(wp + b * gap + p);
        for (int64_t r = 0; r < rows; ++r) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[r * row_stride + p * pair_stride]);
            for (int b = 0; b < blocks; ++b) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], xv, wv[b]);
        }
    }
    if (mode == EPILOGUE_SWIGLU) {
        const __m512 bg = bias ? widen16(bias + nb * 16) : _mm512_setzero_ps();
        const __m512 bu = bias ? widen16(bias + n + nb * 16) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; ++r) {
            uint16_t g[16], u[16], *dst = y + (m0 + r) * n + nb * 16;
            _mm256_storeu_si256((__m256i *)g, to_bf16(_mm512_add_ps(acc[0][r], bg)));
            _mm256_storeu_si256((__m256i *)u, to_bf16(_mm512_add_ps(acc[1][r], bu)));
#pragma omp simd
            for (int i = 0; i < 16; ++i)
                dst[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(silu_f32(bf16_to_f32(g[i])))) * bf16_to_f32(u[i]));
        }
        return;
    }
    for (int b = 0; b < blocks; ++b) {
        const __m512 bv = bias ? widen16(bias + (nb + b) * 16) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; ++r) {
            uint16_t *dst = y + (m0 + r) * n + (nb + b) * 16;
            const __m512 sum = mode == EPILOGUE_ACCUMULATE ? _mm512_add_ps(acc[b][r], widen16(dst))
                                                           : _mm512_add_ps(acc[b][r], bv);
            _mm256_storeu_si256((__m256i *)dst, to_bf16(sum));
        }
    }
}

/* Constant row and block counts let the compiler keep the accumulators in registers and unroll the loops. x: the
 * rows as they are, or (panels non-NULL) regrouped by regroup_rows, where full passes read them. */
static void column_block_any(const void *x, const uint32_t *panels, const uint16_t *packed, const uint16_t *bias,
                             uint16_t *y, int64_t m0, int64_t rows, int64_t nb, int blocks, int64_t n, int64_t k,
                             int mode) {
    const int64_t pairs = k / 2;
    if (panels && rows == ROWS_PER_PASS) {
        const uint32_t *xp = panels + m0 * pairs; /* panel m0 / ROWS_PER_PASS */
        if (blocks == 2)
            column_blocks(xp, 1, ROWS_PER_PASS, packed, bias, y, m0, ROWS_PER_PASS, nb, 2, n, k, mode);
        else
            column_blocks(xp, 1, ROWS_PER_PASS, packed, bias, y, m0, ROWS_PER_PASS, nb, 1, n, k, mode);
        return;
    }
    const uint32_t *xp = (const uint32_t *)x + m0 * pairs;
    switch (rows * 2 + blocks - 1) {
#define CASE(R)                                                                                   \
    case 2 * R: column_blocks(xp, pairs, 1, packed, bias, y, m0, R, nb, 1, n, k, mode); break;     \
    case 2 * R + 1: column_blocks(xp, pairs, 1, packed, bias, y, m0, R, nb, 2, n, k, mode); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#undef CASE
    }
}

/* The full passes' rows of x regrouped [m / ROWS_PER_PASS][k / 2][ROWS_PER_PASS] (each pass's k pairs side by side,
 * as 32-bit words): a pass then reads one stream at fixed offsets instead of 12 row pointers, more than the
 * compiler keeps in registers (it spilled them, 3 extra moves per k pair). Measured on Zen 4: +3-6% at 24-2048
 * rows; regrouping a single pass (12-23 rows) measured 0.87-0.93x, so it starts at 2. Each thread regroups the
 * panels of its share. */
#define PANELS_FROM 2
static void regroup_rows(const uint16_t *x, uint32_t *panels, int64_t m, int64_t k) {
    const int64_t pairs = k / 2;
#pragma omp for schedule(static)
    for (int64_t panel = 0; panel < m / ROWS_PER_PASS; ++panel)
        for (int64_t p = 0; p < pairs; ++p)
            for (int64_t r = 0; r < ROWS_PER_PASS; ++r)
                panels[(panel * pairs + p) * ROWS_PER_PASS + r] =
                    ((const uint32_t *)x)[(panel * ROWS_PER_PASS + r) * pairs + p];
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* 8 float32 -> 8 bf16 in the low half of each 32-bit lane, round to nearest even (bf16.h's f32_to_bf16). */
static inline __m256i bf16_lanes(__m256 v) {
    const __m256i u = _mm256_castps_si256(v), top = _mm256_srli_epi32(u, 16);
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(top, _mm256_set1_epi32(1)));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256i quiet = _mm256_or_si256(top, _mm256_set1_epi32(0x40)); /* NaN stays NaN */
    return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

/* Columns 0-7 (lo) and 8-15 (hi) of a block, rounded to bf16, to 16 consecutive outputs. */
static inline void store16(uint16_t *dst, __m256 lo, __m256 hi) {
    const __m256i packed = _mm256_packus_epi32(bf16_lanes(lo), bf16_lanes(hi)); /* lo0-3 hi0-3 | lo4-7 hi4-7 */
    _mm256_storeu_si256((__m256i *)dst, _mm256_permute4x64_epi64(packed, 0xd8));
}

/* 8 bf16 -> 8 float32 (exact). */
static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Rows [m0, m0 + rows) of y for the column block nb; rows <= ROWS_PER_PASS. xf: x widened to float32, as
 * bits (read as integers so that gcc sees they cannot alias the float accumulators, kept in registers). */
static inline __attribute__((always_inline)) void column_block(const uint32_t *xf, const uint16_t *packed,
                                                              const uint16_t *bias, uint16_t *y, int64_t m0,
                                                              int64_t rows, int64_t nb, int64_t n, int64_t k,
                                                              int accumulate) {
    __m256 acc[2 * ROWS_PER_PASS]; /* row r: columns 0-7 in acc[2r], 8-15 in acc[2r + 1] */
    for (int64_t r = 0; r < 2 * rows; ++r) acc[r] = _mm256_setzero_ps();
    const uint32_t *xr = xf + m0 * k;
    const __m256i *wp = (const __m256i *)(packed + nb * k * 16), high = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t p = 0; p < k; ++p) {
        const __m256i w = _mm256_loadu_si256(wp + p); /* lane i: column i (low half), column 8 + i (high) */
        const __m256 wlo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        const __m256 whi = _mm256_castsi256_ps(_mm256_and_si256(w, high));
        for (int64_t r = 0; r < rows; ++r) {
            const __m256 xv = _mm256_castsi256_ps(_mm256_set1_epi32((int)xr[r * k + p]));
            acc[2 * r] = _mm256_fmadd_ps(xv, wlo, acc[2 * r]);
            acc[2 * r + 1] = _mm256_fmadd_ps(xv, whi, acc[2 * r + 1]);
        }
    }
    const __m256 blo = bias ? widen8(bias + nb * 16) : _mm256_setzero_ps();
    const __m256 bhi = bias ? widen8(bias + nb * 16 + 8) : _mm256_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
        uint16_t *dst = y + (m0 + r) * n + nb * 16;
        if (accumulate)
            store16(dst, _mm256_add_ps(acc[2 * r], widen8(dst)), _mm256_add_ps(acc[2 * r + 1], widen8(dst + 8)));
        else
            store16(dst, _mm256_add_ps(acc[2 * r], blo), _mm256_add_ps(acc[2 * r + 1], bhi));
    }
}

static void column_block_any(const void *x, const uint32_t *panels, const uint16_t *packed, const uint16_t *bias,
                             uint16_t *y, int64_t m0, int64_t rows, int64_t nb, int blocks, int64_t n, int64_t k,
                             int mode) {
    (void)blocks, (void)panels; /* one column block a pass here (no SwiGLU mode: gemm refuses it), x as it is */
    const uint32_t *xf = x;
    switch (rows) {
#define CASE(R) \
    case R: column_block(xf, packed, bias, y, m0, R, nb, n, k, mode == EPILOGUE_ACCUMULATE); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#undef CASE
    }
}
#endif

/* y [M, N] = x [M, K] . w^T (+ bias [N]), or y += x . w^T in EPILOGUE_ACCUMULATE (then no bias), all bf16, with
 * w packed by pack_weight; in EPILOGUE_SWIGLU (the AVX-512 BF16 layout only) w is a fused gate/up weight [N, K]
 * and y [M, N / 2] its SwiGLU. Column blocks, BLOCKS_PER_PASS at a time (a gate block and its up block in
 * SwiGLU), are split over the threads; their weights stay in cache while every pass of ROWS_PER_PASS rows of x
 * uses them. Status: 0 ok, 1 bad shape (or SwiGLU where the layout has no such pass), 2 no path in this build,
 * 3 out of memory. */
static int gemm(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t m, int64_t n,
                int64_t k, int num_threads, int mode) {
#if LAYOUT != 0
    if (n % 16 || k % 2) return 1;
    const int swiglu = mode == EPILOGUE_SWIGLU;
    if (swiglu && (LAYOUT != 1 || n % 32)) return 1;
    uint32_t *panels = NULL;
#if LAYOUT == 1
    const uint16_t *xs = x;
    if (m / ROWS_PER_PASS >= PANELS_FROM
        && !(panels = malloc(sizeof(uint32_t) * (size_t)((m / ROWS_PER_PASS) * ROWS_PER_PASS * (k / 2)))))
        return 3;
#else
    uint32_t *xs = malloc(sizeof(uint32_t) * (size_t)(m * k > 0 ? m * k : 1));
    if (!xs) return 3;
    for (int64_t i = 0; i < m * k; ++i) xs[i] = (uint32_t)x[i] << 16; /* bf16 -> float32 bits, exact */
#endif
    const int64_t blocks = n / 16, out_n = swiglu ? n / 2 : n;
    const int64_t passes = swiglu ? blocks / 2 : (blocks + BLOCKS_PER_PASS - 1) / BLOCKS_PER_PASS;
#pragma omp parallel num_threads(num_threads)
    {
#if LAYOUT == 1
        if (panels) regroup_rows(x, panels, m, k); /* its loop ends in a barrier: every panel is ready after it */
#endif
#pragma omp for schedule(static)
        for (int64_t pass = 0; pass < passes; ++pass) {
            const int64_t nb = swiglu ? pass : pass * BLOCKS_PER_PASS;
            const int these = swiglu ? 2 : blocks - nb < BLOCKS_PER_PASS ? (int)(blocks - nb) : BLOCKS_PER_PASS;
            for (int64_t m0 = 0; m0 < m; m0 += ROWS_PER_PASS)
                column_block_any(xs, panels, packed, bias, y, m0, m - m0 < ROWS_PER_PASS ? m - m0 : ROWS_PER_PASS, nb,
                                 these, out_n, k, mode);
        }
    }
#if LAYOUT == 2
    free(xs);
#endif
    free(panels);
    return 0;
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)num_threads, (void)mode;
    return 2;
#endif
}

int skinny_gemm(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t m,
                int64_t n, int64_t k, int num_threads) {
    return gemm(x, packed, bias, y, m, n, k, num_threads, EPILOGUE_PLAIN);
}

int skinny_gemm_accumulate(const uint16_t *x, const uint16_t *packed, uint16_t *y, int64_t m, int64_t n, int64_t k,
                           int num_threads) {
    return gemm(x, packed, NULL, y, m, n, k, num_threads, EPILOGUE_ACCUMULATE);
}

/* act [M, N / 2] = SwiGLU(x . w^T (+ bias)) for a fused gate/up weight w [N, K] (gate rows first), without
 * storing the projection: the same bits as skinny_gemm then fused_ops.c's swiglu. */
int skinny_gemm_swiglu(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *act, int64_t m,
                       int64_t n, int64_t k, int num_threads) {
    return gemm(x, packed, bias, act, m, n, k, num_threads, EPILOGUE_SWIGLU);
}

/* Whether skinny_gemm_swiglu has a path in this build. */
int fuses_swiglu(void) { return LAYOUT == 1; }
