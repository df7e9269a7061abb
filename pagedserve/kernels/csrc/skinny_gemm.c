/* bfloat16 matmul for few rows (small decode batches): y[M, N] = x[M, K] . w[N, K]^T (+ bias), fp32 sums.
 *
 * With few rows, the BLAS path spends its time re-laying out the weights on every call (bf16 dot-product
 * instructions need pairs of k values side by side), and runs far below peak. Here the weights are laid out
 * once, at load time, as [N / 16][K / 2][16][2]: for a block of 16 output columns, one 64-byte vector per
 * pair of k holds that pair for all 16 columns. A step then streams the weights once, front to back: per
 * vector, one AVX-512 BF16 dot product per input row adds 2 products into each of the row's 16 column sums
 * (the row's k pair is broadcast), so there are no horizontal sums and every load is used by all rows.
 * Each output is one fp32 lane summed in k order, whatever M is: a row's result does not depend on the batch.
 *
 * Plain C with OpenMP, called through ctypes (pagedserve/kernels/skinny_gemm.py).
 */
#include <stdint.h>
#include <string.h>

#define ROWS_PER_PASS 16 /* accumulators held in registers per pass over a column block */

int available(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* w [N, K] bf16 -> packed [N / 16][K / 2][16][2]. Requires N % 16 == 0 and K % 2 == 0. */
int pack_weight(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k) {
    if (n % 16 || k % 2) return 1;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < n / 16; ++nb)
        for (int64_t p = 0; p < k / 2; ++p)
            for (int64_t i = 0; i < 16; ++i) {
                uint16_t *dst = packed + ((nb * (k / 2) + p) * 16 + i) * 2;
                const uint16_t *src = w + (nb * 16 + i) * k + 2 * p;
                dst[0] = src[0];
                dst[1] = src[1];
            }
    return 0;
}

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* 16 float32 -> 16 bf16, round to nearest even (as torch rounds). */
static inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

/* Rows [m0, m0 + rows) of y for the column block nb; rows <= ROWS_PER_PASS. */
static inline __attribute__((always_inline)) void column_block(const uint16_t *x, const uint16_t *packed,
                                                              const uint16_t *bias, uint16_t *y, int64_t m0,
                                                              int64_t rows, int64_t nb, int64_t n, int64_t k) {
    __m512 acc[ROWS_PER_PASS];
    for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
    const uint32_t *xp = (const uint32_t *)x + m0 * (k / 2); /* k pairs of each row */
    const __m512i *wp = (const __m512i *)(packed + nb * (k / 2) * 32);
    for (int64_t p = 0; p < k / 2; ++p) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wp + p);
        for (int64_t r = 0; r < rows; ++r)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)xp[r * (k / 2) + p]), wv);
    }
    __m512 b = _mm512_setzero_ps();
    if (bias)
        b = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + nb * 16))), 16));
    for (int64_t r = 0; r < rows; ++r)
        _mm256_storeu_si256((__m256i *)(y + (m0 + r) * n + nb * 16), to_bf16(_mm512_add_ps(acc[r], b)));
}

/* Constant row counts let the compiler keep the accumulators in registers and unroll the row loop. */
static void column_block_any(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                             int64_t m0, int64_t rows, int64_t nb, int64_t n, int64_t k) {
    switch (rows) {
#define CASE(R) \
    case R: column_block(x, packed, bias, y, m0, R, nb, n, k); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
        CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
    }
}
#endif

/* y [M, N] = x [M, K] . w^T (+ bias [N]), all bf16, with w packed by pack_weight. Column blocks are split over
 * the threads; each block's 16 x K weights stay in cache while every 16-row pass of x uses them. */
int skinny_gemm(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t m,
                int64_t n, int64_t k, int num_threads) {
#if defined(__AVX512BF16__)
    if (n % 16 || k % 2) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t nb = 0; nb < n / 16; ++nb)
        for (int64_t m0 = 0; m0 < m; m0 += ROWS_PER_PASS)
            column_block_any(x, packed, bias, y, m0, m - m0 < ROWS_PER_PASS ? m - m0 : ROWS_PER_PASS, nb, n, k);
    return 0;
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)num_threads;
    return 2;
#endif
}
