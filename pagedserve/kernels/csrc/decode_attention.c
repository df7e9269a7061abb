/* Paged decode attention for CPU: each sequence's one query token attends its whole cached context, read
 * in place from the KV-cache blocks (no gather into a new tensor).
 *
 * Cache layout per layer (pagedserve/attention/kv_layout.py): one (block, kv head) pair is a contiguous tile,
 * [block_size][head_dim] for V and [head_dim / pack][block_size][pack] for K (pack = 2 in bf16, 1 in f32).
 * Query and output: [batch, heads, head_dim]. Work is split over (sequence, kv head) pairs; the query heads
 * that share a KV head are done together so each tile is read once. Accumulation is in float32.
 *
 * 8-bit caches (int8, fp8 e4m3 / e5m2; kv_quant.h) keep K tiles with pack = 1 and a bf16 scale per (token,
 * head) beside the tiles. Every element is dequantized (code * scale, exact in float32) where it is loaded,
 * before any arithmetic, so the result is bit for bit that of the float32 cache path over the dequantized
 * values, on every path (tests/attention/test_decode_attention_quantized.py).
 *
 * Paths, chosen by the build's -march (kernels/build.py picks it from the CPU at run time): with AVX-512,
 * head_dim 64/128 and block_size % 16 == 0 take item_avx512 (16 tokens a vector; bf16 K by BF16 dot
 * products where the CPU has AVX512-BF16); with AVX2 + FMA only, the same shapes with block_size % 8 == 0
 * take item_avx2 (8 tokens a vector, bf16 widened by shifts). Everything else takes the plain C loop.
 * With AVX512-BF16, a bf16 call whose consecutive rows read the same blocks (a prompt's tokens, each a decode up
 * to its own position) computes them in tiles (prefill_tiles.h), each row bit for bit what it gets alone.
 *
 * Plain C with OpenMP, called through ctypes: it builds in about a second with gcc and needs no torch headers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fast_exp.h"
#include "kv_quant.h"

#define MAX_GROUP 16
#define SCORE_HEADS 4 /* AVX2: query heads whose scores are summed together (2 x 4 sums in registers) */
#define MAX_HEAD_DIM 256  /* also: MAX_GROUP * 128 <= MAX_GROUP * MAX_HEAD_DIM for the fast path's output */
#define MAX_BLOCK 64
/* How many blocks ahead the AVX-512 path fetches K tiles into L2 (2-6 measured the same). Blocks are scattered,
 * so the hardware prefetcher can't see them coming; fetching only the next tile into L1 left a core reading
 * the cache at ~9 GB/s (too few misses in flight). */
#define K_TILES_AHEAD 3

/* Fetch a cache tile of `bytes` at `tile` (char *) with a _mm_prefetch hint, line by line. */
#define prefetch_tile(tile, bytes, hint)                                                      \
    do {                                                                                      \
        for (int64_t off_ = 0; off_ < (bytes); off_ += 64) _mm_prefetch((tile) + off_, hint); \
    } while (0)

/* count query values (bf16 or f32) to float32. bf16 is the top half of a float32. */
static inline void query_to_f32(const void *src, int qbf16, int64_t count, float *restrict dst) {
    if (qbf16) {
        const uint16_t *s = (const uint16_t *)src;
        uint32_t *d = (uint32_t *)dst;
#pragma omp simd
        for (int64_t i = 0; i < count; ++i) d[i] = (uint32_t)s[i] << 16;
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)count);
    }
}

/* Element i of a cache tile as float32; in an 8-bit cache, code * the token's scale (kv_quant.h: exact). */
static inline float cache_value(const void *src, int kv, int64_t i, const uint16_t *scales, int64_t token) {
    if (kv == KV_F32) return ((const float *)src)[i];
    if (kv == KV_BF16) return bf16_to_f32(((const uint16_t *)src)[i]);
    return kv_decode(((const uint8_t *)src)[i], kv) * bf16_to_f32(scales[token]);
}

/* The first n tokens of a V tile [block_size][head_dim] as float32 rows [n][head_dim]. */
static inline void value_tile_to_rows(const void *src, int kv, int64_t n, int64_t head_dim, const uint16_t *scales,
                                      float *restrict rows) {
    if (kv == KV_F32) {
        memcpy(rows, src, sizeof(float) * (size_t)(n * head_dim));
        return;
    }
    for (int64_t t = 0; t < n; ++t)
        for (int64_t d = 0; d < head_dim; ++d) rows[t * head_dim + d] = cache_value(src, kv, t * head_dim + d, scales, t);
}

/* The first n tokens of a K tile [head_dim / pack][block_size][pack] as float32 rows [n][head_dim]. */
static inline void key_tile_to_rows(const void *src, int kv, int64_t n, int64_t head_dim, int64_t block_size,
                                    const uint16_t *scales, float *restrict rows) {
    const int64_t pack = kv == KV_BF16 ? 2 : 1;
    for (int64_t t = 0; t < n; ++t)
        for (int64_t d = 0; d < head_dim; ++d) {
            const int64_t at = (d / pack) * block_size * pack + t * pack + d % pack;
            rows[t * head_dim + d] = cache_value(src, kv, at, scales, t);
        }
}

/* Each of the group's score rows [len] (row g at scores + g * len, maximum maxs[g]) -> its softmax, in place. */
static inline void softmax_rows(float *scores, const float *maxs, int64_t group, int64_t len) {
    for (int64_t g = 0; g < group; ++g) {
        float *sg = scores + g * len, m = maxs[g], sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
            sg[t] = exp_nonpositive(sg[t] - m);
            sum += sg[t];
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
    }
}

/* out[at : at + head_dim] = src, rounded to the output dtype. */
static inline void store_row(void *out, int64_t at, const float *src, int64_t head_dim, int qbf16) {
    if (qbf16) {
        uint16_t *dst = (uint16_t *)out + at;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = f32_to_bf16(src[d]);
    } else {
        memcpy((float *)out + at, src, sizeof(float) * (size_t)head_dim);
    }
}

/* Bytes per cache element, and how many dimensions a K tile keeps together per token. */
static inline int64_t kv_elem(int kv) { return kv == KV_F32 ? 4 : kv == KV_BF16 ? 2 : 1; }
static inline int64_t kv_pack(int kv) { return kv == KV_BF16 ? 2 : 1; }

/* What the SIMD paths multiply a scale by: they read e4m3 codes through float16 (bits << 7), which is the
 * code's value / 256 (exact), so its scale is taken * 256 (exact too). */
static inline float scale_factor(int kv) { return kv == KV_FP8_E4M3 ? 256.f : 1.f; }

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 8-bit codes to float32 (before their scale; e4m3 as value / 256, see scale_factor). */
static inline __attribute__((always_inline)) __m512 codes16(const void *p, const int kv) {
    const __m128i c = _mm_loadu_si128((const __m128i *)p);
    if (kv == KV_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
    const __m256i w = _mm256_cvtepu8_epi16(c);
    if (kv == KV_FP8_E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
    return _mm512_cvtph_ps(_mm256_or_si256(sign, _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7)));
}

/* 16 cache values of one row (f32, bf16, or 8-bit codes before their scale) to a float32 vector. */
static inline __attribute__((always_inline)) __m512 load16(const void *p, const int kv) {
    if (kv == KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    if (kv == KV_F32) return _mm512_loadu_ps((const float *)p);
    return codes16(p, kv);
}

/* 16 bf16 scales (times scale_factor) as float32. */
static inline __attribute__((always_inline)) __m512 scales16(const uint16_t *p, const int kv) {
    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return kv == KV_FP8_E4M3 ? _mm512_mul_ps(s, _mm512_set1_ps(256.f)) : s;
}

/* exp_nonpositive (fast_exp.h) on 16 lanes: the same steps, written with intrinsics so that every lane gets
 * the same arithmetic wherever it sits in a row. */
static inline __m512 exp_nonpositive16(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(t, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
    static const float c[] = {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    for (int i = 0; i < 7; ++i) p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(c[i]));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* One score row [len] with maximum m -> exp(score - m) in place; returns 1 / their sum (0 for an empty row), by
 * which the weighted sum of V rows is multiplied at the end (one product per output element instead of one per
 * probability). 16 lanes at a time with a masked tail, in one compiled copy (noinline): a fixed order of the sum
 * whatever the row's address or length, so that a row gives the same bits in a decode item and in a prefill tile
 * (prefill_tiles.h). */
static __attribute__((noinline)) float softmax_row_avx512(float *row, float m, int64_t len) {
    const __m512 vm = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
        const int64_t n = len - t < 16 ? len - t : 16;
        const __mmask16 mask = (__mmask16)(n == 16 ? 0xffff : (1u << n) - 1u);
        const __m512 e = _mm512_maskz_mov_ps(mask, exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + t), vm)));
        sum = _mm512_add_ps(sum, e);
        _mm512_mask_storeu_ps(row + t, mask, e);
    }
    const float total = _mm512_reduce_add_ps(sum);
    return total > 0.f ? 1.f / total : 0.f;
}

/* Scores of one (sequence, kv head) item, 16 tokens at a time: scores[g * len + t] = scale * q_g . k_t and
 * maxs[g] = max_t of them. K tiles are [head_dim / pack][block_size][pack] (kv_layout.py), so one row of a
 * tile holds dimension group p of 16 consecutive tokens: the query's value(s) for that group are broadcast
 * and multiplied into a vector of 16 token scores, with no horizontal sums. In bf16, pack = 2 and one
 * AVX-512 BF16 dot product does both dimensions of a pair (products exact, sums in float32). In an 8-bit
 * cache each row is dequantized (codes * their tokens' scales) first, so the sums are those of a float32
 * cache holding the dequantized values. Requires block_size % 16 == 0. */
static inline __attribute__((always_inline)) void scores_avx512(
    const char *query, const char *key_cache, const uint16_t *key_scale, const int64_t *table, int64_t len,
    float *scores, float *maxs, int64_t group, int64_t block_size, int64_t head_dim, int64_t tile_bytes,
    int64_t row0, int64_t kv_stride, const char *value_cache, float scale, const int qbf16, const int kv) {
    __m512 vmax[MAX_GROUP];
    for (int64_t g = 0; g < group; ++g) vmax[g] = _mm512_set1_ps(-INFINITY);
    const int64_t pack = kv_pack(kv), groups = head_dim / pack, row_bytes = block_size * pack * kv_elem(kv);
    for (int64_t start = 0; start < len; start += 16) {
        const int64_t b = start / block_size, chunk = (start % block_size) / 16;
        const char *tile = key_cache + table[b] * kv_stride * tile_bytes + chunk * 16 * pack * kv_elem(kv);
        if (chunk == 0) {
            /* K tiles K_TILES_AHEAD blocks ahead into L2 (at the first block, all of them up to there), this
             * block's V tile into L2 for the second pass, then the next K tile from L2 into L1 (in this order:
             * the other one measured 4% slower). */
            const int64_t blocks = (len + block_size - 1) / block_size;
            for (int64_t ahead = b == 0 ? 1 : b + K_TILES_AHEAD; ahead <= b + K_TILES_AHEAD && ahead < blocks; ++ahead)
                prefetch_tile(key_cache + table[ahead] * kv_stride * tile_bytes, tile_bytes, _MM_HINT_T1);
            prefetch_tile(value_cache + table[b] * kv_stride * tile_bytes, tile_bytes, _MM_HINT_T1);
            if (b + 1 < blocks) prefetch_tile(key_cache + table[b + 1] * kv_stride * tile_bytes, tile_bytes, _MM_HINT_T0);
        }
        __m512 acc[MAX_GROUP];
        for (int64_t g = 0; g < group; ++g) acc[g] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
        if (kv == KV_BF16) {
            const uint32_t *q = (const uint32_t *)(query + row0 * head_dim * 2); /* bf16 pairs */
            for (int64_t p = 0; p < groups; ++p) {
                const __m512bh k = (__m512bh)_mm512_loadu_si512(tile + p * row_bytes);
                for (int64_t g = 0; g < group; ++g)
                    acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)_mm512_set1_epi32((int)q[g * groups + p]), k);
            }
        } else
#endif
        {
            const __m512 token_scales = kv_is_quantized(kv)
                ? scales16(key_scale + table[b] * kv_stride * block_size + chunk * 16, kv) : _mm512_setzero_ps();
            for (int64_t p = 0; p < groups; ++p) {
                const char *row = tile + p * row_bytes;
                for (int64_t j = 0; j < pack; ++j) {
                    /* 16 tokens' value of dimension p * pack + j */
                    __m512 k;
                    if (kv == KV_BF16) {
                        const __m512i pairs = _mm512_loadu_si512(row);
                        k = _mm512_castsi512_ps(j == 0 ? _mm512_slli_epi32(pairs, 16)
                                                       : _mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
                    } else {
                        k = load16(row, kv);
                        if (kv_is_quantized(kv)) k = _mm512_mul_ps(k, token_scales);
                    }
                    const int64_t d = p * pack + j;
                    for (int64_t g = 0; g < group; ++g) {
                        const int64_t at = (row0 + g) * head_dim + d;
                        const float qd = qbf16 ? bf16_to_f32(((const uint16_t *)query)[at]) : ((const float *)query)[at];
                        acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(qd), k, acc[g]);
                    }
                }
            }
        }
        const int64_t n = len - start < 16 ? len - start : 16;
        const __mmask16 mask = (__mmask16)(n == 16 ? 0xffff : (1u << n) - 1u);
        const __m512 vscale = _mm512_set1_ps(scale);
        for (int64_t g = 0; g < group; ++g) {
            const __m512 s = _mm512_mul_ps(acc[g], vscale);
            _mm512_mask_storeu_ps(scores + g * len + start, mask, s);
            vmax[g] = _mm512_mask_max_ps(vmax[g], mask, vmax[g], s);
        }
    }
    for (int64_t g = 0; g < group; ++g) maxs[g] = _mm512_reduce_max_ps(vmax[g]);
}

/* One (sequence, kv head) work item with head_dim = 16 * NV: the scores above, softmax, then the weighted
 * sum of V rows held in registers. Called with a constant nv so that the compiler unrolls every loop over j. */
static inline __attribute__((always_inline)) void item_avx512(
    const char *query, const char *key_cache, const char *value_cache, const uint16_t *key_scale,
    const uint16_t *value_scale, const int64_t *table, int64_t len, float *scores, int64_t group,
    int64_t block_size, int64_t tile, int64_t row0, int64_t kv_stride, float scale, const int qbf16, const int kv,
    const int nv, float *out_f32) {
    const int64_t elem = kv_elem(kv), head_dim = 16 * nv;
    __m512 o[MAX_GROUP][8], k[8];
    float maxs[MAX_GROUP];
    for (int64_t g = 0; g < group; ++g)
        for (int j = 0; j < nv; ++j) o[g][j] = _mm512_setzero_ps();
    scores_avx512(query, key_cache, key_scale, table, len, scores, maxs, group, block_size, head_dim, tile * elem,
                  row0, kv_stride, value_cache, scale, qbf16, kv);
    float inv[MAX_GROUP];
    for (int64_t g = 0; g < group; ++g) inv[g] = softmax_row_avx512(scores + g * len, maxs[g], len);
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t blk = table[start / block_size], n = len - start < block_size ? len - start : block_size;
        const char *rows = value_cache + blk * kv_stride * tile * elem;
        const uint16_t *token_scales = kv_is_quantized(kv) ? value_scale + blk * kv_stride * block_size : NULL;
        if (start + block_size < len) /* the next V tile, from L2 (the first pass fetched it there) */
            prefetch_tile(value_cache + table[start / block_size + 1] * kv_stride * tile * elem, tile * elem,
                          _MM_HINT_T0);
        for (int64_t i = 0; i < n; ++i) {
            const char *row = rows + i * head_dim * elem;
            for (int j = 0; j < nv; ++j) k[j] = load16(row + 16 * j * elem, kv);
            if (kv_is_quantized(kv)) {
                const __m512 s = _mm512_set1_ps(bf16_to_f32(token_scales[i]) * scale_factor(kv));
                for (int j = 0; j < nv; ++j) k[j] = _mm512_mul_ps(k[j], s);
            }
            for (int64_t g = 0; g < group; ++g) {
                const __m512 p = _mm512_set1_ps(scores[g * len + start + i]);
                for (int j = 0; j < nv; ++j) o[g][j] = _mm512_fmadd_ps(p, k[j], o[g][j]);
            }
        }
    }
    for (int64_t g = 0; g < group; ++g)
        for (int j = 0; j < nv; ++j)
            _mm512_storeu_ps(out_f32 + g * head_dim + 16 * j, _mm512_mul_ps(o[g][j], _mm512_set1_ps(inv[g])));
}

#if defined(__AVX512BF16__)
#include "prefill_tiles.h"
#define HAS_PREFILL_TILES 1
#endif

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* 8 8-bit codes to float32 (before their scale; e4m3 as value / 256, see scale_factor). */
static inline __attribute__((always_inline)) __m256 codes8(const void *p, const int kv) {
    const __m128i c = _mm_loadl_epi64((const __m128i *)p);
    if (kv == KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
    const __m128i w = _mm_cvtepu8_epi16(c);
    if (kv == KV_FP8_E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(w, 8));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
    return _mm256_cvtph_ps(_mm_or_si128(sign, _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7)));
}

/* 8 cache values of one row (f32, bf16, or 8-bit codes before their scale) to a float32 vector. */
static inline __attribute__((always_inline)) __m256 load8(const void *p, const int kv) {
    if (kv == KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    if (kv == KV_F32) return _mm256_loadu_ps((const float *)p);
    return codes8(p, kv);
}

/* 8 bf16 scales (times scale_factor) as float32. */
static inline __attribute__((always_inline)) __m256 scales8(const uint16_t *p, const int kv) {
    const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return kv == KV_FP8_E4M3 ? _mm256_mul_ps(s, _mm256_set1_ps(256.f)) : s;
}

static inline float max_lane(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* float32 value qb[g * head_dim + d] broadcast (the query is passed as float32 bits so that gcc sees its
 * loads cannot alias the float vectors it accumulates into). */
static inline __m256 broadcast_bits(const uint32_t *qb, int64_t at) {
    return _mm256_castsi256_ps(_mm256_set1_epi32((int)qb[at]));
}

/* Scores of `group` query heads (a constant from 1 to SCORE_HEADS) of one (sequence, kv head) item, as
 * scores_avx512 does: one row of a K tile holds dimension group p of CHUNKS x 8 consecutive tokens and the query's
 * value(s) are broadcast. In bf16 the row holds a pair of dimensions per token: a shift and a mask widen it to two
 * float32 vectors (exact); 8-bit codes are dequantized with their tokens' scales. Every head and 8-token chunk has
 * its own sum (group * CHUNKS independent chains: one chain waits on the FMA's latency at each step), and each
 * token's sum runs over the dimensions in order, so the result does not depend on how many heads or chunks go
 * together. qb: the heads' queries as float32 bits [group][head_dim]. chunks (a constant, 1 or 2): 8-token chunks
 * a step; block_size % (8 * chunks) == 0. */
static inline __attribute__((always_inline)) void scores_avx2(
    const uint32_t *qb, const char *key_cache, const uint16_t *key_scale, const int64_t *table, int64_t len,
    float *scores, float *maxs, const int64_t group, int64_t block_size, int64_t head_dim, int64_t tile_bytes,
    int64_t kv_stride, const char *value_cache, float scale, const int kv, const int chunks) {
    __m256 vmax[SCORE_HEADS];
    for (int64_t g = 0; g < group; ++g) vmax[g] = _mm256_set1_ps(-INFINITY);
    const int64_t pack = kv_pack(kv), groups = head_dim / pack, row_bytes = block_size * pack * kv_elem(kv);
    const int64_t step = 8 * chunks;
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u), lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t start = 0; start < len; start += step) {
        const int64_t b = start / block_size, chunk = (start % block_size) / 8;
        const char *tile = key_cache + table[b] * kv_stride * tile_bytes + chunk * 8 * pack * kv_elem(kv);
        if (chunk == 0) { /* as in scores_avx512 */
            const int64_t blocks = (len + block_size - 1) / block_size;
            for (int64_t ahead = b == 0 ? 1 : b + K_TILES_AHEAD; ahead <= b + K_TILES_AHEAD && ahead < blocks; ++ahead)
                prefetch_tile(key_cache + table[ahead] * kv_stride * tile_bytes, tile_bytes, _MM_HINT_T1);
            prefetch_tile(value_cache + table[b] * kv_stride * tile_bytes, tile_bytes, _MM_HINT_T1);
            if (b + 1 < blocks) prefetch_tile(key_cache + table[b + 1] * kv_stride * tile_bytes, tile_bytes, _MM_HINT_T0);
        }
        __m256 acc[SCORE_HEADS][2], token_scales[2];
        for (int64_t g = 0; g < group; ++g)
            for (int c = 0; c < chunks; ++c) acc[g][c] = _mm256_setzero_ps();
        for (int c = 0; c < chunks; ++c)
            token_scales[c] = kv_is_quantized(kv)
                ? scales8(key_scale + table[b] * kv_stride * block_size + (chunk + c) * 8, kv) : _mm256_setzero_ps();
        for (int64_t p = 0; p < groups; ++p) {
            const char *row = tile + p * row_bytes;
            if (kv == KV_BF16) {
                for (int c = 0; c < chunks; ++c) {
                    const __m256i pairs = _mm256_loadu_si256((const __m256i *)(row + c * 32));
                    const __m256 k0 = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
                    const __m256 k1 = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
                    for (int64_t g = 0; g < group; ++g) {
                        acc[g][c] = _mm256_fmadd_ps(broadcast_bits(qb, g * head_dim + 2 * p), k0, acc[g][c]);
                        acc[g][c] = _mm256_fmadd_ps(broadcast_bits(qb, g * head_dim + 2 * p + 1), k1, acc[g][c]);
                    }
                }
            } else {
                __m256 k[2];
                for (int c = 0; c < chunks; ++c) {
                    k[c] = load8(row + c * 8 * kv_elem(kv), kv);
                    if (kv_is_quantized(kv)) k[c] = _mm256_mul_ps(k[c], token_scales[c]);
                }
                for (int64_t g = 0; g < group; ++g) {
                    const __m256 qv = broadcast_bits(qb, g * head_dim + p);
                    for (int c = 0; c < chunks; ++c) acc[g][c] = _mm256_fmadd_ps(qv, k[c], acc[g][c]);
                }
            }
        }
        /* lanes past the context (stale cache rows, maybe NaN) are neither stored nor in the maximum */
        const __m256 vscale = _mm256_set1_ps(scale);
        for (int c = 0; c < chunks; ++c) {
            const int64_t at = start + 8 * c, here = len - at < 8 ? (len - at > 0 ? len - at : 0) : 8;
            const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)here), lanes);
            const __m256 vvalid = _mm256_castsi256_ps(valid);
            for (int64_t g = 0; g < group; ++g) {
                const __m256 s = _mm256_mul_ps(acc[g][c], vscale);
                _mm256_maskstore_ps(scores + g * len + at, valid, s);
                vmax[g] = _mm256_blendv_ps(vmax[g], _mm256_max_ps(vmax[g], s), vvalid);
            }
        }
    }
    for (int64_t g = 0; g < group; ++g) maxs[g] = max_lane(vmax[g]);
}

/* out_f32 [head_dim] = probs [len] . V rows of one (sequence, kv head) item, head_dim = 8 * nv (a constant, 8 or
 * 16): the weighted sum of V rows in registers, token by token. */
static inline __attribute__((always_inline)) void values_avx2(
    const float *probs, const char *value_cache, const uint16_t *value_scale, const int64_t *table, int64_t len,
    int64_t block_size, int64_t tile, int64_t kv_stride, const int kv, const int nv, int fetch, float *out_f32) {
    const int64_t elem = kv_elem(kv), head_dim = 8 * nv;
    __m256 o[16], v[16];
    for (int j = 0; j < nv; ++j) o[j] = _mm256_setzero_ps();
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t blk = table[start / block_size], n = len - start < block_size ? len - start : block_size;
        const char *rows = value_cache + blk * kv_stride * tile * elem;
        const uint16_t *token_scales = kv_is_quantized(kv) ? value_scale + blk * kv_stride * block_size : NULL;
        if (fetch && start + block_size < len) /* as in item_avx512 */
            prefetch_tile(value_cache + table[start / block_size + 1] * kv_stride * tile * elem, tile * elem,
                          _MM_HINT_T0);
        for (int64_t i = 0; i < n; ++i) {
            const char *row = rows + i * head_dim * elem;
            for (int j = 0; j < nv; ++j) v[j] = load8(row + 8 * j * elem, kv);
            if (kv_is_quantized(kv)) {
                const __m256 s = _mm256_set1_ps(bf16_to_f32(token_scales[i]) * scale_factor(kv));
                for (int j = 0; j < nv; ++j) v[j] = _mm256_mul_ps(v[j], s);
            }
            const __m256 p = _mm256_set1_ps(probs[start + i]);
            for (int j = 0; j < nv; ++j) o[j] = _mm256_fmadd_ps(p, v[j], o[j]);
        }
    }
    for (int j = 0; j < nv; ++j) _mm256_storeu_ps(out_f32 + 8 * j, o[j]);
}

/* `group` query heads (a constant up to SCORE_HEADS) of one (sequence, kv head) work item, head_dim = 8 * nv:
 * their scores together (each K tile read once for all of them), softmax, then each head's weighted sum of V
 * rows alone (16 vector registers hold one head's sums beside its V row; the V tiles stay in cache for the
 * next head). */
static inline __attribute__((always_inline)) void item_avx2(
    const uint32_t *qb, const char *key_cache, const char *value_cache, const uint16_t *key_scale,
    const uint16_t *value_scale, const int64_t *table, int64_t len, float *scores, const int64_t group,
    int64_t block_size, int64_t tile, int64_t kv_stride, float scale, const int kv, const int nv, const int chunks,
    float *out_f32) {
    const int64_t head_dim = 8 * nv;
    float maxs[SCORE_HEADS];
    scores_avx2(qb, key_cache, key_scale, table, len, scores, maxs, group, block_size, head_dim,
                tile * kv_elem(kv), kv_stride, value_cache, scale, kv, chunks);
    softmax_rows(scores, maxs, group, len);
    for (int64_t g = 0; g < group; ++g)
        values_avx2(scores + g * len, value_cache, value_scale, table, len, block_size, tile, kv_stride, kv, nv,
                    g == 0, out_f32 + g * head_dim);
}
#endif

/* One (sequence, kv head) pair; returns nonzero if it could not get memory. */
static inline __attribute__((always_inline)) int decode_item(
    const void *query, const void *key_cache, const void *value_cache, const uint16_t *key_scale,
    const uint16_t *value_scale, const int64_t *block_tables, const int64_t *context_lens, void *out, int64_t work,
    int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
    const int qbf16, const int kv) {
    const int64_t group = num_heads / kv_heads, elem = kv_elem(kv), qelem = qbf16 ? 2 : 4;
    const int64_t tile = block_size * head_dim;
    const int64_t b = work / kv_heads, h = work % kv_heads, len = context_lens[b], row0 = b * num_heads + h * group;
    const int64_t *table = block_tables + b * max_blocks;
    float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], rows[MAX_BLOCK * MAX_HEAD_DIM];
    float maxs[MAX_GROUP];
    float *scores = malloc(sizeof(float) * (size_t)(group * (len > 0 ? len : 1)));
    if (!scores) return 1;
    /* caches offset to this kv head; kv_stride = kv_heads turns block ids into tile ids */
    const char *kc = (const char *)key_cache + h * tile * elem, *vc = (const char *)value_cache + h * tile * elem;
    const uint16_t *ks = key_scale ? key_scale + h * block_size : NULL;
    const uint16_t *vs = value_scale ? value_scale + h * block_size : NULL;
#if defined(__AVX512F__)
    if ((head_dim == 64 || head_dim == 128) && block_size % 16 == 0) {
        /* The query heads of a KV head go through in chunks of a constant size (the K and V tiles stay in cache
         * for the next chunk): a constant count lets the compiler keep the accumulators in registers, where a
         * runtime one left them on the stack, a store and a load per product (1.1-1.2x slower here). */
        const int64_t most = head_dim == 64 ? 4 : 2; /* accumulators: most * head_dim / 16 vectors */
        for (int64_t g0 = 0; g0 < group; g0 += most) {
            const int64_t count = group - g0 < most ? group - g0 : most;
#define ITEM(G, NV) item_avx512((const char *)query, kc, vc, ks, vs, table, len, scores, G, block_size, tile, \
                                row0 + g0, kv_heads, scale, qbf16, kv, NV, acc[0] + g0 * head_dim)
            if (head_dim == 64) {
                switch (count) {
                case 1: ITEM(1, 4); break;
                case 2: ITEM(2, 4); break;
                case 3: ITEM(3, 4); break;
                default: ITEM(4, 4);
                }
            } else if (count == 1) {
                ITEM(1, 8);
            } else {
                ITEM(2, 8);
            }
#undef ITEM
        }
        for (int64_t g = 0; g < group; ++g) store_row(out, (row0 + g) * head_dim, acc[0] + g * head_dim, head_dim, qbf16);
        free(scores);
        return 0;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if ((head_dim == 64 || head_dim == 128) && block_size % 8 == 0) {
        uint32_t qb[MAX_GROUP * MAX_HEAD_DIM];
        query_to_f32((const char *)query + row0 * head_dim * qelem, qbf16, group * head_dim, (float *)qb);
        /* The query heads go through SCORE_HEADS at a time, a constant count for each call (the compiler then
         * keeps the sums in registers); 8-token chunks two at a time where blocks hold whole pairs. */
        for (int64_t g0 = 0; g0 < group; g0 += SCORE_HEADS) {
            const int64_t count = group - g0 < SCORE_HEADS ? group - g0 : SCORE_HEADS;
            const uint32_t *qg = qb + g0 * head_dim;
            float *og = acc[0] + g0 * head_dim;
#define ITEM(G, NV, C) item_avx2(qg, kc, vc, ks, vs, table, len, scores, G, block_size, tile, kv_heads, scale, kv, \
                                 NV, C, og)
#define ITEMS(NV, C)                   \
    switch (count) {                   \
    case 1: ITEM(1, NV, C); break;     \
    case 2: ITEM(2, NV, C); break;     \
    case 3: ITEM(3, NV, C); break;     \
    default: ITEM(4, NV, C);           \
    }
            if (head_dim == 64 && block_size % 16 == 0) ITEMS(8, 2)
            else if (head_dim == 64) ITEMS(8, 1)
            else if (block_size % 16 == 0) ITEMS(16, 2)
            else ITEMS(16, 1)
#undef ITEMS
#undef ITEM
        }
        for (int64_t g = 0; g < group; ++g) store_row(out, (row0 + g) * head_dim, acc[0] + g * head_dim, head_dim, qbf16);
        free(scores);
        return 0;
    }
#endif
    for (int64_t g = 0; g < group; ++g) {
        query_to_f32((const char *)query + (row0 + g) * head_dim * qelem, qbf16, head_dim, q[g]);
        for (int64_t d = 0; d < head_dim; ++d) {
            q[g][d] *= scale;
            acc[g][d] = 0.f;
        }
        maxs[g] = -INFINITY;
    }
    /* scores = q . k for every cached token, one block tile at a time */
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t blk = table[start / block_size];
        const int64_t n = len - start < block_size ? len - start : block_size;
        key_tile_to_rows(kc + blk * kv_heads * tile * elem, kv, n, head_dim, block_size,
                         ks ? ks + blk * kv_heads * block_size : NULL, rows);
        for (int64_t g = 0; g < group; ++g)
            for (int64_t t = 0; t < n; ++t) {
                const float *k = rows + t * head_dim;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < head_dim; ++d) s += q[g][d] * k[d];
                scores[g * len + start + t] = s;
                maxs[g] = s > maxs[g] ? s : maxs[g];
            }
    }
    softmax_rows(scores, maxs, group, len);
    /* out = softmax(scores) . v */
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t blk = table[start / block_size];
        const int64_t n = len - start < block_size ? len - start : block_size;
        value_tile_to_rows(vc + blk * kv_heads * tile * elem, kv, n, head_dim,
                           vs ? vs + blk * kv_heads * block_size : NULL, rows);
        for (int64_t g = 0; g < group; ++g)
            for (int64_t t = 0; t < n; ++t) {
                const float p = scores[g * len + start + t], *v = rows + t * head_dim;
                float *a = acc[g];
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
            }
    }
    for (int64_t g = 0; g < group; ++g) store_row(out, (row0 + g) * head_dim, acc[g], head_dim, qbf16);
    free(scores);
    return 0;
}

/* Whether the bf16 entry point splits its rows into prefill tiles (prefill_tiles.h): AVX-512 BF16 builds,
 * head_dim 64 / 128, blocks of a multiple of 16 tokens. */
static int tiles_apply(int64_t head_dim, int64_t block_size) {
#if defined(HAS_PREFILL_TILES)
    return (head_dim == 64 || head_dim == 128) && block_size % 16 == 0;
#else
    (void)head_dim, (void)block_size;
    return 0;
#endif
}

/* bf16 query and cache: rows that read the same blocks (a prompt's tokens) go in tiles of up to TILE_TOKENS, one
 * work item per (tile, kv head); a row alone (a decode) is a decode_item as before. Same results either way.
 * Returns -1 without computing anything when no two rows form a tile (a decode batch). */
static int tiled(const void *query, const void *key_cache, const void *value_cache, const int64_t *block_tables,
                 const int64_t *context_lens, void *out, int64_t batch, int64_t num_heads, int64_t kv_heads,
                 int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int num_threads) {
#if defined(HAS_PREFILL_TILES)
    int64_t *starts;
    const int64_t runs = tile_runs(block_tables, context_lens, batch, max_blocks, block_size, &starts);
    if (runs < 0) return 2;
    if (runs == batch) { /* all decodes */
        free(starts);
        return -1;
    }
    int failed = 0;
    /* chunks of 4 items, as the decode loop takes them: a decode's kv heads stay on one thread, together (chunks
     * of 1 measured 0.91x on decode items) */
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 4) reduction(| : failed)
    for (int64_t work = 0; work < runs * kv_heads; ++work) {
        const int64_t run = work / kv_heads, h = work % kv_heads, first = starts[run];
        const int64_t tokens = starts[run + 1] - first;
        if (tokens == 1)
            failed |= decode_item(query, key_cache, value_cache, NULL, NULL, block_tables, context_lens, out,
                                  first * kv_heads + h, num_heads, kv_heads, head_dim, block_size, max_blocks, scale,
                                  1, KV_BF16);
        else
            failed |= prefill_tile((const uint16_t *)query, (const char *)key_cache, (const char *)value_cache,
                                   block_tables + first * max_blocks, context_lens, (uint16_t *)out, first, tokens, h,
                                   num_heads, kv_heads, head_dim, block_size, scale);
    }
    free(starts);
    return failed ? 2 : 0;
#else
    (void)query, (void)key_cache, (void)value_cache, (void)block_tables, (void)context_lens, (void)out, (void)batch;
    (void)num_heads, (void)kv_heads, (void)head_dim, (void)block_size, (void)max_blocks, (void)scale, (void)num_threads;
    return 1;
#endif
}

/* Entry points, one per (query dtype, cache kind). The parallel loop is written in each (not in a shared
 * inline function) because OpenMP outlines it before inlining, which would turn the flags back into runtime
 * values. key_scale / value_scale: the bf16 scales of an 8-bit cache [num_blocks][kv_heads][block_size],
 * else NULL. */
#define DECODE_ENTRY(NAME, QBF16, KV)                                                                           \
    int NAME(const void *query, const void *key_cache, const void *value_cache, const uint16_t *key_scale,       \
             const uint16_t *value_scale, const int64_t *block_tables, const int64_t *context_lens, void *out,    \
             int64_t batch, int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,           \
             int64_t max_blocks, float scale, int num_threads) {                                                 \
        const int64_t group = num_heads / kv_heads;                                                              \
        if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK || group * kv_heads != num_heads) \
            return 1;                                                                                            \
        if (kv_is_quantized(KV) && (!key_scale || !value_scale)) return 3;                                        \
        if (QBF16 && KV == KV_BF16 && tiles_apply(head_dim, block_size)) {                                        \
            const int status = tiled(query, key_cache, value_cache, block_tables, context_lens, out, batch,       \
                                     num_heads, kv_heads, head_dim, block_size, max_blocks, scale, num_threads);   \
            if (status >= 0) return status; /* else no two rows formed a tile: the loop below */                  \
        }                                                                                                        \
        int failed = 0;                                                                                          \
        _Pragma("omp parallel for num_threads(num_threads) schedule(dynamic, 4) reduction(| : failed)")          \
        for (int64_t work = 0; work < batch * kv_heads; ++work)                                                  \
            failed |= decode_item(query, key_cache, value_cache, key_scale, value_scale, block_tables,            \
                                  context_lens, out, work, num_heads, kv_heads, head_dim, block_size, max_blocks,  \
                                  scale, QBF16, KV);                                                             \
        return failed ? 2 : 0;                                                                                   \
    }

DECODE_ENTRY(decode_attention_f32, 0, KV_F32)
DECODE_ENTRY(decode_attention_bf16, 1, KV_BF16)
DECODE_ENTRY(decode_attention_f32_int8, 0, KV_INT8)
DECODE_ENTRY(decode_attention_f32_fp8_e4m3, 0, KV_FP8_E4M3)
DECODE_ENTRY(decode_attention_f32_fp8_e5m2, 0, KV_FP8_E5M2)
DECODE_ENTRY(decode_attention_bf16_int8, 1, KV_INT8)
DECODE_ENTRY(decode_attention_bf16_fp8_e4m3, 1, KV_FP8_E4M3)
DECODE_ENTRY(decode_attention_bf16_fp8_e5m2, 1, KV_FP8_E5M2)
