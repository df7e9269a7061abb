/* A grammar's token bitmask applied to logits (structured output): every token whose bit is 0 gets -inf.
 *
 * The bitmask is xgrammar's layout: per row, ceil(vocab / 32) int32 words, bit j of word w for token
 * 32 w + j. A word with every bit set (all 32 tokens allowed: most words inside a JSON string) is skipped, one
 * with none set (most words between JSON elements) is 32 stores the compiler vectorizes, the rest go bit by
 * bit. 16 rows of 49,152 tokens (benchmarks/structured_output.py, Zen 4): 0.03 ms, against 1.5 ms for torch's
 * way (unpack every bit, then masked_fill) and 2.3 ms for xgrammar's CPU apply.
 *
 * Plain C with OpenMP over rows, called through ctypes (pagedserve/kernels/token_bitmask.py).
 */
#include <stdint.h>

#define NEG_INF_F32 0xff800000u
#define NEG_INF_BF16 0xff80u

/* Tokens [32 w, 32 w + 32) of one row that `banned` names (all 32 when it is all ones: one vector store). */
#define BAN_WORD(TYPE, NEG)                                                                                \
    do {                                                                                                   \
        TYPE *out = (TYPE *)logits + rows[i] * vocab + 32 * w;                                             \
        if (banned == 0xffffffffu && 32 * w + 32 <= vocab) {                                               \
            for (int j = 0; j < 32; ++j) out[j] = NEG;                                                     \
        } else {                                                                                           \
            for (; banned; banned &= banned - 1) {                                                         \
                const int j = __builtin_ctz(banned);                                                       \
                if (32 * w + j < vocab) out[j] = NEG;                                                      \
            }                                                                                              \
        }                                                                                                  \
    } while (0)

/* logits [*, vocab] (row stride `vocab`), rows[i] its row i's place; bitmask [num_rows, words]. */
int apply_token_bitmask(void *logits, const int32_t *bitmask, const int64_t *rows, int64_t num_rows,
                        int64_t vocab, int64_t words, int bf16, int num_threads) {
    if (words * 32 < vocab) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows > 4)
    for (int64_t i = 0; i < num_rows; ++i) {
        const uint32_t *mask = (const uint32_t *)bitmask + i * words;
        for (int64_t w = 0; w < words; ++w) {
            uint32_t banned = ~mask[w];
            if (!banned) continue;
            if (bf16)
                BAN_WORD(uint16_t, (uint16_t)NEG_INF_BF16);
            else
                BAN_WORD(uint32_t, NEG_INF_F32);
        }
    }
    return 0;
}
