/* Prefill attention in tiles, for decode_attention.c's AVX-512 BF16 path (bf16 query and cache): included there
 * after the helpers it uses (load16, store_row, softmax_row_avx512, prefetch-free reads).
 *
 * On CPU every prompt token is a decode of its own over the cache up to its position (attention/metadata.py,
 * per_token). Done one (token, kv head) item at a time, each item reloads its sequence's K and V tiles, fetches
 * them again (they are already in cache after the sequence's first token) and keeps only the kv head's group of
 * query heads (3 for SmolLM2) busy per K row loaded. Here the entry point finds runs of consecutive rows that read
 * the same blocks (a prompt's tokens: identical block tables over the blocks the longest of them needs) and gives
 * each run of up to TILE_TOKENS tokens and each kv head one work item: TILE_SCORE_ROWS query rows share every K
 * row load, TILE_VALUE_ROWS rows every widened V row, and nothing is prefetched.
 *
 * Every row is computed exactly as decode_item computes it alone, so a token's result does not depend on
 * whether it was tiled (tested bit for bit): the same BF16 dot-product chain per lane over the dimension pairs
 * in order, the same scale and masked max, the same softmax_row_avx512, and the same FMA per output element over
 * the tokens in order. Rows past a row's own length are computed in shared vectors but never stored or added.
 */
#ifndef PAGEDSERVE_PREFILL_TILES_H
#define PAGEDSERVE_PREFILL_TILES_H

#define TILE_TOKENS 8     /* tokens of one sequence in a work item */
#define TILE_SCORE_ROWS 12 /* query rows (token, head) whose dot products share each K row: 12 sums in flight */
#define TILE_MAX_ROWS (TILE_TOKENS * MAX_GROUP)

typedef struct {
    const uint32_t *query; /* the row's query, bf16 pairs */
    int64_t len;           /* tokens it attends */
    float *scores;         /* [len]: scores, then exp(score - max) */
    float max, inv;        /* the scores' maximum; 1 / the sum of their exponentials */
    float *sums;           /* [head_dim] float32 output sums */
} tile_row;

/* Scores of rows[0 .. count) (count <= TILE_SCORE_ROWS) over 16-token chunks up to the longest of them. Rows past
 * count repeat the last one's query (constant trip counts keep the sums in registers); they are not stored. The
 * queries are copied side by side first ([pair][row]), so that one pointer reaches them all. */
static inline void tile_scores(tile_row *rows, int count, const char *key_cache, const int64_t *table,
                               int64_t block_size, int64_t tile_bytes, int64_t kv_stride, int64_t pairs, float scale) {
    uint32_t q[MAX_HEAD_DIM / 2][TILE_SCORE_ROWS];
    int64_t longest = 0;
    __m512 vmax[TILE_SCORE_ROWS];
    for (int r = 0; r < TILE_SCORE_ROWS; ++r) {
        const uint32_t *query = rows[r < count ? r : count - 1].query;
        for (int64_t p = 0; p < pairs; ++p) q[p][r] = query[p];
        vmax[r] = _mm512_set1_ps(-INFINITY);
    }
    for (int r = 0; r < count; ++r) longest = rows[r].len > longest ? rows[r].len : longest;
    const int64_t row_bytes = block_size * 2 * 2; /* pack 2, bf16 */
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t start = 0; start < longest; start += 16) {
        const char *tile = key_cache + table[start / block_size] * kv_stride * tile_bytes + (start % block_size) * 4;
        __m512 acc[TILE_SCORE_ROWS];
        for (int r = 0; r < TILE_SCORE_ROWS; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; ++p) {
            const __m512bh k = (__m512bh)_mm512_loadu_si512(tile + p * row_bytes);
            for (int r = 0; r < TILE_SCORE_ROWS; ++r)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)q[p][r]), k);
        }
        for (int r = 0; r < count; ++r) {
            if (start >= rows[r].len) continue;
            const int64_t n = rows[r].len - start < 16 ? rows[r].len - start : 16;
            const __mmask16 mask = (__mmask16)(n == 16 ? 0xffff : (1u << n) - 1u);
            const __m512 s = _mm512_mul_ps(acc[r], vscale);
            _mm512_mask_storeu_ps(rows[r].scores + start, mask, s);
            vmax[r] = _mm512_mask_max_ps(vmax[r], mask, vmax[r], s);
        }
    }
    for (int r = 0; r < count; ++r) rows[r].max = _mm512_reduce_max_ps(vmax[r]);
}

/* o[r] += e_rt * v_t over tokens [from, to) of one V tile (rows of nv vectors), for the vr rows; with `check`, only
 * for rows whose length takes token base + t. One FMA per output element per token, in token order. */
static inline __attribute__((always_inline)) void add_values(__m512 o[][8], const float *const *p, const char *tile,
                                                            int64_t from, int64_t to, int64_t base,
                                                            const int64_t *len, const int vr, const int nv,
                                                            const int check) {
    __m512 v[8];
    for (int64_t t = from; t < to; ++t) {
        for (int j = 0; j < nv; ++j) v[j] = load16(tile + t * nv * 32 + 32 * j, KV_BF16);
        for (int r = 0; r < vr; ++r) {
            if (check && base + t >= len[r]) continue;
            const __m512 pr = _mm512_set1_ps(p[r][base + t]);
            for (int j = 0; j < nv; ++j) o[r][j] = _mm512_fmadd_ps(pr, v[j], o[r][j]);
        }
    }
}

/* rows[r].sums = (sum over t < rows[r].len of e_rt * v_t) * rows[r].inv, for count <= vr rows of head_dim 16 * nv (vr, nv
 * constant at each call), each output element one FMA per token in token order, as item_avx512 adds them:
 * tokens every row takes without a length check, then the rest with it. */
static inline __attribute__((always_inline)) void tile_values(tile_row *rows, int count, const char *value_cache,
                                                             const int64_t *table, int64_t block_size,
                                                             int64_t tile_bytes, int64_t kv_stride, const int vr,
                                                             const int nv) {
    __m512 o[6][8];
    const float *p[6];
    int64_t longest = 0, shortest = INT64_MAX, len[6];
    for (int r = 0; r < vr; ++r) {
        len[r] = r < count ? rows[r].len : 0;
        p[r] = rows[r < count ? r : 0].scores;
        longest = len[r] > longest ? len[r] : longest;
        shortest = len[r] < shortest ? len[r] : shortest;
        for (int j = 0; j < nv; ++j) o[r][j] = _mm512_setzero_ps();
    }
    for (int64_t base = 0; base < longest; base += block_size) {
        const char *tile = value_cache + table[base / block_size] * kv_stride * tile_bytes;
        const int64_t n = longest - base < block_size ? longest - base : block_size;
        const int64_t all = shortest - base < 0 ? 0 : shortest - base < n ? shortest - base : n;
        add_values(o, p, tile, 0, all, base, len, vr, nv, 0);
        add_values(o, p, tile, all, n, base, len, vr, nv, 1);
    }
    for (int r = 0; r < count; ++r)
        for (int j = 0; j < nv; ++j)
            _mm512_storeu_ps(rows[r].sums + 16 * j, _mm512_mul_ps(o[r][j], _mm512_set1_ps(rows[r].inv)));
}

/* One work item: tokens [first, first + tokens) of one sequence (they share its block table) and kv head h.
 * Returns nonzero if it could not get memory. */
static int prefill_tile(const uint16_t *query, const char *key_cache, const char *value_cache,
                        const int64_t *table, const int64_t *context_lens, uint16_t *out, int64_t first,
                        int64_t tokens, int64_t h, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                        int64_t block_size, float scale) {
    const int64_t group = num_heads / kv_heads, tile = block_size * head_dim;
    const int count = (int)(tokens * group);
    tile_row rows[TILE_MAX_ROWS];
    int64_t total = 0;
    for (int64_t t = 0; t < tokens; ++t) total += group * context_lens[first + t];
    float *scores = malloc(sizeof(float) * (size_t)(total > 0 ? total : 1));
    float *sums = malloc(sizeof(float) * (size_t)(count * head_dim));
    if (!scores || !sums) {
        free(scores);
        free(sums);
        return 1;
    }
    float *next = scores;
    for (int i = 0; i < count; ++i) {
        const int64_t t = first + i / group, row = t * num_heads + h * group + i % group;
        rows[i] = (tile_row){(const uint32_t *)(query + row * head_dim), context_lens[t], next, 0.f, 0.f,
                             sums + i * head_dim};
        next += context_lens[t];
    }
    /* caches offset to this kv head, as in decode_item */
    const char *kc = key_cache + h * tile * 2, *vc = value_cache + h * tile * 2;
    for (int r0 = 0; r0 < count; r0 += TILE_SCORE_ROWS)
        tile_scores(rows + r0, count - r0 < TILE_SCORE_ROWS ? count - r0 : TILE_SCORE_ROWS, kc, table, block_size,
                    tile * 2, kv_heads, head_dim / 2, scale);
    for (int r = 0; r < count; ++r) rows[r].inv = softmax_row_avx512(rows[r].scores, rows[r].max, rows[r].len);
    for (int r0 = 0; r0 < count; r0 += head_dim == 64 ? 6 : 3) {
        const int left = count - r0;
        if (head_dim == 64)
            tile_values(rows + r0, left < 6 ? left : 6, vc, table, block_size, tile * 2, kv_heads, 6, 4);
        else
            tile_values(rows + r0, left < 3 ? left : 3, vc, table, block_size, tile * 2, kv_heads, 3, 8);
    }
    for (int i = 0; i < count; ++i) {
        const int64_t t = first + i / group, row = t * num_heads + h * group + i % group;
        store_row(out, row * head_dim, rows[i].sums, head_dim, 1);
    }
    free(scores);
    free(sums);
    return 0;
}

/* Whether rows a and b of the block tables read the same blocks for every token either attends. */
static inline int same_blocks(const int64_t *block_tables, const int64_t *context_lens, int64_t a, int64_t b,
                              int64_t max_blocks, int64_t block_size) {
    const int64_t longest = context_lens[a] > context_lens[b] ? context_lens[a] : context_lens[b];
    const int64_t blocks = (longest + block_size - 1) / block_size;
    return blocks <= max_blocks &&
           memcmp(block_tables + a * max_blocks, block_tables + b * max_blocks, sizeof(int64_t) * (size_t)blocks) == 0;
}

/* Splits rows [0, batch) into runs of at most TILE_TOKENS consecutive rows that read the same blocks: starts[i]
 * is run i's first row (starts[runs] = batch). Returns the number of runs, or -1 if out of memory. */
static int64_t tile_runs(const int64_t *block_tables, const int64_t *context_lens, int64_t batch, int64_t max_blocks,
                         int64_t block_size, int64_t **starts) {
    *starts = malloc(sizeof(int64_t) * (size_t)(batch + 1));
    if (!*starts) return -1;
    int64_t runs = 0;
    for (int64_t b = 0; b < batch; ++b)
        if (b == 0 || b - (*starts)[runs - 1] >= TILE_TOKENS ||
            !same_blocks(block_tables, context_lens, (*starts)[runs - 1], b, max_blocks, block_size))
            (*starts)[runs++] = b;
    (*starts)[runs] = batch;
    return runs;
}

#endif
