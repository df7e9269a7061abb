/* All decoder layers of one decode step, for a small batch in bfloat16, as one call from Python.
 *
 * With a few sequences a step's kernels are short (tens of microseconds each), and the Python between them
 * (module calls, tensor allocations, ctypes argument conversion: ~300 calls a step) took as long as the
 * matmuls themselves. This file owns no arithmetic: it runs the same kernels the Python path runs (RMSNorm,
 * the small-batch matmul, RoPE + KV write, decode attention, SwiGLU: function pointers into their own
 * libraries, each built with its own flags), in the same order on the same buffers, so the result is bit for
 * bit that of the Python path (tests/kernels/test_decode_layers.py checks it).
 *
 * Per layer, as LlamaDecoderLayer.forward (x: the layer's input, res: the residual stream):
 *   h = norm(x, res)   [first layer: res = x, h = norm(x)]
 *   qkv = h W_qkv (+ b); rotate q, k and store k, v in the cache; q copied out contiguous
 *   x = attention(q) W_o (+ b);  h = norm(x, res);  x = swiglu(h W_gate_up (+ b)) W_down (+ b)
 * On return `hidden` holds the last layer's x and `residual` the stream; the caller applies the final norm.
 * The KV cache is bf16 or 8-bit (the attention entry point and kv_kind match it).
 *
 * With LoRA rows (Step.lora set), each of the four matmuls is followed by its adapters' deltas, as
 * lora/layers.py's LinearLoRA.add_delta computes them: per run of rows of one slot, t = x A^T with the gemm,
 * then y += t B^T with the accumulating gemm (the same packed slot weights). Base-model rows are in no run.
 */
#include <stdint.h>
#include <string.h>

typedef int (*rms_norm_fn)(const void *x, void *residual, const void *weight, void *out, int64_t rows,
                           int64_t dim, float eps, int bf16, int threads);
typedef int (*gemm_fn)(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t m,
                       int64_t n, int64_t k, int threads);
typedef int (*rotary_fn)(void *qkv, int64_t row_stride, const int64_t *positions, const float *cos_table,
                         const float *sin_table, void *key_cache, void *value_cache, uint16_t *key_scale,
                         uint16_t *value_scale, const int64_t *slots, int64_t tokens, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, int64_t block_size, int kv_kind, int bf16, int threads);
typedef int (*attention_fn)(const void *query, const void *key_cache, const void *value_cache,
                            const uint16_t *key_scale, const uint16_t *value_scale, const int64_t *block_tables,
                            const int64_t *context_lens, void *out, int64_t batch, int64_t heads, int64_t kv_heads,
                            int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int threads);
typedef int (*swiglu_fn)(const void *gate_up, void *out, int64_t rows, int64_t d, int bf16, int threads);
typedef int (*gemm_accumulate_fn)(const uint16_t *x, const uint16_t *packed, uint16_t *y, int64_t m, int64_t n,
                                  int64_t k, int threads);
typedef int (*quant_gemm_fn)(const void *x, const uint8_t *packed, const void *bias, void *y, int64_t m, int64_t n,
                             int64_t k, int kind, int bf16, int threads, const int64_t *order);

typedef struct {
    rms_norm_fn rms_norm;
    gemm_fn gemm;
    gemm_accumulate_fn gemm_accumulate;
    rotary_fn rotary;
    attention_fn attention;
    swiglu_fn swiglu;
    quant_gemm_fn quant_gemm; /* for block-quantized weights (quant_gemm.c) */
    gemm_fn gemm_swiglu;      /* the gate/up matmul ending in SwiGLU (skinny_gemm_swiglu), or NULL: gemm, swiglu */
} Kernels;

typedef struct { /* one layer's weights (packed for the gemm; biases NULL when absent) and its KV cache (the
                    scales NULL unless the cache is 8-bit) */
    const void *input_norm, *post_norm;
    const void *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    void *key_cache, *value_cache;
    uint16_t *key_scale, *value_scale;
    int64_t kinds[4]; /* qkv, o, gate_up, down: 0 bf16 packed for the gemm, else quant_gemm's kind (with flags) */
    const int64_t *orders[4]; /* block-quantized from GPTQ act-order: the order of the inputs, else NULL */
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size, kv_kind; /* kv_kind: kv_quant.h */
    float eps, scale;
} Shape;

typedef struct { /* one linear's LoRA slots: slot s has A packed as a [width, in] weight at a + s * a_stride and B
                    as a [out, width] weight at b + s * b_stride; width 0: its adapter leaves the linear alone */
    const uint16_t *a, *b;
    const int64_t *widths;
    int64_t a_stride, b_stride;
} LinearLoRA;

typedef struct {
    LinearLoRA qkv, o, gate_up, down;
} LayerLoRA;

typedef struct { /* a run of rows [start, stop) of one slot */
    int64_t slot, start, stop;
} LoRAGroup;

typedef struct { /* this step */
    int64_t rows, max_blocks;
    const int64_t *positions, *slots, *block_tables, *context_lens;
    const float *cos_table, *sin_table;
    uint16_t *hidden, *residual; /* [rows, hidden] each: in (embeddings in hidden) and out */
    uint16_t *scratch;           /* scratch_elements(shape, rows) bf16 values */
    const LayerLoRA *lora;       /* per layer, or NULL: no row of this step has an adapter */
    const LoRAGroup *groups;
    int64_t num_groups;
    uint16_t *lora_scratch; /* [rows, the widest slot] bf16 */
    int threads;
} Step;

/* bf16 elements of scratch a step of `rows` needs: qkv, q, attention out, normed h, gate_up, activation. */
int64_t scratch_elements(const Shape *s, int64_t rows) {
    const int64_t q = s->heads * s->head_dim, qkv = q + 2 * s->kv_heads * s->head_dim;
    return rows * (qkv + 2 * q + s->hidden + 3 * s->intermediate);
}

/* y [rows, n] += each run's slot delta of x [rows, in]. */
static int add_lora(const Kernels *k, const LinearLoRA *l, const Step *st, const uint16_t *x, uint16_t *y,
                    int64_t n, int64_t in) {
    for (int64_t g = 0; g < st->num_groups; ++g) {
        const LoRAGroup *run = st->groups + g;
        const int64_t width = l->widths[run->slot], rows = run->stop - run->start;
        if (!width) continue;
        int status = k->gemm(x + run->start * in, l->a + run->slot * l->a_stride, NULL, st->lora_scratch, rows,
                             width, in, st->threads);
        if (status || (status = k->gemm_accumulate(st->lora_scratch, l->b + run->slot * l->b_stride,
                                                   y + run->start * n, rows, n, width, st->threads)))
            return status;
    }
    return 0;
}

/* The base matmul y = x W^T (+ b), then the LoRA deltas when the step has any (lora: this linear's slots).
 * kind 0: w is bf16 packed for the gemm; else block-quantized for quant_gemm. */
static int linear(const Kernels *k, const Step *st, const LinearLoRA *lora, const uint16_t *x, const void *w,
                  const void *bias, uint16_t *y, int64_t n, int64_t in, int64_t kind, const int64_t *order) {
    const int status = kind ? k->quant_gemm(x, w, bias, y, st->rows, n, in, (int)kind, 1, st->threads, order)
                            : k->gemm(x, w, bias, y, st->rows, n, in, st->threads);
    return status || !lora ? status : add_lora(k, lora, st, x, y, n, in);
}

static int layer(const Kernels *k, const Layer *w, const LayerLoRA *lora, const Shape *s, const Step *st,
                 int first) {
    const int64_t m = st->rows, q_size = s->heads * s->head_dim, qkv_size = q_size + 2 * s->kv_heads * s->head_dim;
    uint16_t *qkv = st->scratch, *q = qkv + m * qkv_size, *attn = q + m * q_size, *h = attn + m * q_size;
    uint16_t *gate_up = h + m * s->hidden, *act = gate_up + m * 2 * s->intermediate;
    const int t = st->threads;
    int status;
    if (first) {
        memcpy(st->residual, st->hidden, sizeof(uint16_t) * (size_t)(m * s->hidden));
        status = k->rms_norm(st->hidden, NULL, w->input_norm, h, m, s->hidden, s->eps, 1, t);
    } else {
        status = k->rms_norm(st->hidden, st->residual, w->input_norm, h, m, s->hidden, s->eps, 1, t);
    }
    if (status || (status = linear(k, st, lora ? &lora->qkv : NULL, h, w->qkv, w->qkv_bias, qkv, qkv_size, s->hidden, w->kinds[0],
                                  w->orders[0])))
        return status;
    status = k->rotary(qkv, qkv_size, st->positions, st->cos_table, st->sin_table, w->key_cache, w->value_cache,
                       w->key_scale, w->value_scale, st->slots, m, s->heads, s->kv_heads, s->head_dim,
                       s->block_size, (int)s->kv_kind, 1, t);
    if (status) return status;
    for (int64_t r = 0; r < m; ++r)
        memcpy(q + r * q_size, qkv + r * qkv_size, sizeof(uint16_t) * (size_t)q_size);
    status = k->attention(q, w->key_cache, w->value_cache, w->key_scale, w->value_scale, st->block_tables,
                          st->context_lens, attn, m, s->heads, s->kv_heads, s->head_dim, s->block_size,
                          st->max_blocks, s->scale, t);
    if (status || (status = linear(k, st, lora ? &lora->o : NULL, attn, w->o, w->o_bias, st->hidden, s->hidden, q_size, w->kinds[1],
                                  w->orders[1])))
        return status;
    if ((status = k->rms_norm(st->hidden, st->residual, w->post_norm, h, m, s->hidden, s->eps, 1, t))) return status;
    if (k->gemm_swiglu && !w->kinds[2] && !lora) { /* the same bits as the two calls below, in one pass */
        status = k->gemm_swiglu(h, w->gate_up, w->gate_up_bias, act, m, 2 * s->intermediate, s->hidden, t);
    } else if (!(status = linear(k, st, lora ? &lora->gate_up : NULL, h, w->gate_up, w->gate_up_bias, gate_up,
                                 2 * s->intermediate, s->hidden, w->kinds[2], w->orders[2]))) {
        status = k->swiglu(gate_up, act, m, s->intermediate, 1, t);
    }
    if (status) return status;
    return linear(k, st, lora ? &lora->down : NULL, act, w->down, w->down_bias, st->hidden, s->hidden, s->intermediate,
                  w->kinds[3], w->orders[3]);
}

/* Returns 0, or 100 * (layer + 1) + the failing kernel's status. */
int decode_layers(const Kernels *k, const Layer *layers, int64_t num_layers, const Shape *s, const Step *st) {
    for (int64_t i = 0; i < num_layers; ++i) {
        const int status = layer(k, layers + i, st->lora ? st->lora + i : NULL, s, st, i == 0);
        if (status) return (int)(100 * (i + 1)) + status;
    }
    return 0;
}
