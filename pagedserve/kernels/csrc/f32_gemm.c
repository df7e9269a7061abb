/* float32 matmul with weights packed once: y[M, N] = x[M, K] . w[N, K]^T (+ bias), for machines whose fastest
 * dtype is float32 and whose widest vectors are AVX2's (no AVX-512, no native bf16: AMD EPYC before Zen 4).
 * With AVX-512, torch's sgemm uses 512-bit FMAs, twice this kernel's peak: there is no path at those levels.
 *
 * torch's float32 linear goes to MKL's sgemm, which re-packs the weights on every call and, on these AMD CPUs,
 * runs well below the FMA peak on the model's shapes. Here the weights are laid out once, at load time, as
 * [N / 16][K][16]: for a block of 16 output columns, one 64-byte run per k. A tile of ROWS rows x 16 columns
 * keeps its 2 * ROWS sums in registers; per k, two loads of the weight run serve every row (x[r][k] broadcast).
 *
 * Blocking, per thread (threads split the column blocks): rows in panels of up to ROW_PANEL, k in slices of
 * up to K_SLICE. A (row panel x k slice) piece of x (<= 640 KiB) stays in L2/L3 while the thread walks its
 * column blocks; a column block's (k slice x 16) weights (<= 40 KiB) stay near L1 while every row tile of the
 * panel uses them. Partial sums go through y between k slices. Measured against torch 2.13's sgemm (MKL) on
 * 2 Zen 3 cores, the default model's shapes (benchmarks/f32_matmul.py, docs/benchmarks.md): 1.07-1.41x at 256
 * rows (the 49,152-column LM head most), 1.01-1.16x at 2,048, 1.5-3.1x at 16, 1.6-3.0x at 1 row.
 *
 * Each output is one fp32 lane summed in k order (slices in order, k in order within a slice), whatever M is
 * and however the rows fall into tiles: a row's result does not depend on the batch. Without AVX2 + FMA there
 * is no path: available() is 0 and layers use torch.
 *
 * Plain C with OpenMP, called through ctypes (pagedserve/kernels/f32_gemm.py).
 */
#include <stdint.h>
#include <omp.h>
#include <string.h>

#define ROW_PANEL 256 /* measured on Zen 3: 192 and 128 rows, or slices of 256, were 2-30% slower */
#define K_SLICE 640   /* K = 576 (the default model's hidden size) in one slice, 1536 in three */

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define HAS_PATH 1
#include <immintrin.h>
#define ROWS 6 /* rows per tile: 12 accumulators of the 16 vector registers */

int available(void) { return 1; }

/* One tile: rows [m0, m0 + rows) x the 16 columns of block nb, over k in [k0, k1). `first`: the sums start
 * from the bias (or 0) instead of from y. */
static inline __attribute__((always_inline)) void tile(const float *x, const float *packed, const float *bias,
                                                      float *y, int64_t m0, int64_t rows, int64_t nb, int64_t n,
                                                      int64_t k, int64_t k0, int64_t k1, int first) {
    __m256 acc[2 * ROWS];
    for (int64_t r = 0; r < rows; ++r) {
        float *dst = y + (m0 + r) * n + nb * 16;
        if (!first) {
            acc[2 * r] = _mm256_loadu_ps(dst);
            acc[2 * r + 1] = _mm256_loadu_ps(dst + 8);
        } else if (bias) {
            acc[2 * r] = _mm256_loadu_ps(bias + nb * 16);
            acc[2 * r + 1] = _mm256_loadu_ps(bias + nb * 16 + 8);
        } else {
            acc[2 * r] = acc[2 * r + 1] = _mm256_setzero_ps();
        }
    }
    /* x and the weights are read as integers, so that gcc sees they cannot alias the float accumulators
     * and keeps those in registers. */
    const uint32_t *xr = (const uint32_t *)x + m0 * k;
    const __m256i *wp = (const __m256i *)(packed + (nb * k + k0) * 16);
    for (int64_t p = k0; p < k1; ++p, wp += 2) {
        const __m256 w0 = _mm256_castsi256_ps(_mm256_loadu_si256(wp));
        const __m256 w1 = _mm256_castsi256_ps(_mm256_loadu_si256(wp + 1));
        for (int64_t r = 0; r < rows; ++r) {
            const __m256 xv = _mm256_castsi256_ps(_mm256_set1_epi32((int)xr[r * k + p]));
            acc[2 * r] = _mm256_fmadd_ps(xv, w0, acc[2 * r]);
            acc[2 * r + 1] = _mm256_fmadd_ps(xv, w1, acc[2 * r + 1]);
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        float *dst = y + (m0 + r) * n + nb * 16;
        _mm256_storeu_ps(dst, acc[2 * r]);
        _mm256_storeu_ps(dst + 8, acc[2 * r + 1]);
    }
}

static void tile_any(const float *x, const float *packed, const float *bias, float *y, int64_t m0, int64_t rows,
                     int64_t nb, int64_t n, int64_t k, int64_t k0, int64_t k1, int first) {
    switch (rows) {
#define CASE(R) \
    case R: tile(x, packed, bias, y, m0, R, nb, n, k, k0, k1, first); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#undef CASE
    }
}

/* Equal slices of at most `most` covering `total` (so that no slice is a short tail). */
static int64_t slice_of(int64_t total, int64_t most) {
    const int64_t count = (total + most - 1) / most;
    return (total + count - 1) / count;
}

/* Column blocks [nb0, nb1) of y, all rows. */
static void columns(const float *x, const float *packed, const float *bias, float *y, int64_t m, int64_t n,
                    int64_t k, int64_t nb0, int64_t nb1) {
    const int64_t panel = slice_of(m, ROW_PANEL), slice = slice_of(k, K_SLICE);
    for (int64_t mp = 0; mp < m; mp += panel) {
        const int64_t mend = mp + panel < m ? mp + panel : m;
        for (int64_t k0 = 0; k0 < k; k0 += slice) {
            const int64_t k1 = k0 + slice < k ? k0 + slice : k;
            for (int64_t nb = nb0; nb < nb1; ++nb)
                for (int64_t m0 = mp; m0 < mend; m0 += ROWS)
                    tile_any(x, packed, bias, y, m0, mend - m0 < ROWS ? mend - m0 : ROWS, nb, n, k, k0, k1, k0 == 0);
        }
    }
}
#else
int available(void) { return 0; }
#endif

/* w [N, K] -> packed [N / 16][K][16]. Status: 0 ok, 1 bad shape. */
int pack_weight(const float *w, float *packed, int64_t n, int64_t k) {
    if (n % 16) return 1;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < n / 16; ++nb)
        for (int64_t p = 0; p < k; ++p)
            for (int64_t i = 0; i < 16; ++i) packed[(nb * k + p) * 16 + i] = w[(nb * 16 + i) * k + p];
    return 0;
}

/* y [M, N] = x [M, K] . w^T (+ bias [N]), with w packed by pack_weight; the column blocks are split evenly over
 * the threads. Status: 0 ok, 1 bad shape, 2 no path in this build. */
int f32_gemm(const float *x, const float *packed, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
             int num_threads) {
#if defined(HAS_PATH)
    if (n % 16) return 1;
    if (m == 0) return 0;
    const int64_t blocks = n / 16;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > blocks) num_threads = (int)blocks;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num(), share = blocks / num_threads, extra = blocks % num_threads;
        const int64_t nb0 = t * share + (t < extra ? t : extra), nb1 = nb0 + share + (t < extra);
        columns(x, packed, bias, y, m, n, k, nb0, nb1);
    }
    return 0;
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)num_threads;
    return 2;
#endif
}
