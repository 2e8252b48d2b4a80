/* Decode attention read in place from kvpush's block-major paged KV cache (fp32, one thread).

   kv:    [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]  (K at index 0, V at 1)
   q:     [B, H, D]        one query token per sequence, contiguous
   table: [B, nb]          each sequence's block ids (padding past its length is never read)
   lens:  [B]              context length per sequence, the query's own token included
   out:   [B, H, D]

   Query head h attends with KV head h / (H / KVH), as torch's scaled_dot_product_attention with
   enable_gqa. Per sequence and KV head the addresses of its context's K and V rows are computed once;
   then per query head the scores (one dot product a K row), a softmax, and the weighted sum of V
   rows, accumulated in registers 32 floats at a time, so the output is written once. The previous
   version went token by token and loaded and stored every head's output row for every token.
   `python benchmarks/decode_kernel.py --against 2e3cb1d` (that version; rows out of L2, as in a real
   step; 6 heads over 3 of 64, block 16; Intel fam 6 model 167, 2026-12-07): new / old 0.85
   [0.82, 0.87] at 16 sequences x 96 tokens, 0.88 at 16 x 500, 0.80 at 64 x 200, 0.93 at one sequence
   of 100. Head sizes 64 and 128 keep the query in registers; sizes that are not a multiple of 8 (32
   for the sums) take plain loops.
   Built by layers/cpu_kernels.py. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));  /* unaligned access */
typedef int i8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { return *(const v8u *)p; }
static inline void store8(float *p, v8 v) { *(v8u *)p = v; }

static inline float hsum8(v8 v) {
    v += __builtin_shuffle(v, (i8){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (i8){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (i8){1, 0, 3, 2, 5, 4, 7, 6});
    return v[0];
}

static float dot(const float *restrict a, const float *restrict b, int64_t n) {
    if (n % 8 == 0) {
        v8 acc0 = {0}, acc1 = {0};
        int64_t d = 0;
        for (; d + 16 <= n; d += 16) {
            acc0 += load8(a + d) * load8(b + d);
            acc1 += load8(a + d + 8) * load8(b + d + 8);
        }
        if (d < n) acc0 += load8(a + d) * load8(b + d);
        return hsum8(acc0 + acc1);
    }
    float acc = 0.0f;
    for (int64_t d = 0; d < n; d++) acc += a[d] * b[d];
    return acc;
}

/* s[j] = q . rows[j] * scale for head size 8 * n8 (a constant where inlined: q stays in registers) */
static inline __attribute__((always_inline)) void scores_fixed(float *restrict s, const float *restrict qh,
                                                               const float *const *rows, int64_t len, float scale,
                                                               const int n8) {
    v8 qv[16];
    for (int i = 0; i < n8; i++) qv[i] = load8(qh + 8 * i);
    for (int64_t j = 0; j < len; j++) {
        const float *k = rows[j];
        v8 a = {0}, b = {0};
        for (int i = 0; i < n8; i += 2) {
            a += qv[i] * load8(k + 8 * i);
            b += qv[i + 1] * load8(k + 8 * i + 8);
        }
        s[j] = hsum8(a + b) * scale;
    }
}

static void scores(float *restrict s, const float *restrict qh, const float *const *rows, int64_t len, int64_t D,
                   float scale) {
    if (D == 64) {
        scores_fixed(s, qh, rows, len, scale, 8);
    } else if (D == 128) {
        scores_fixed(s, qh, rows, len, scale, 16);
    } else {
        for (int64_t j = 0; j < len; j++) s[j] = dot(qh, rows[j], D) * scale;
    }
}

/* p[0..n) = exp(p - max) / their sum */
static void softmax(float *restrict p, int64_t n) {
    float m = p[0];
    for (int64_t j = 1; j < n; j++) m = p[j] > m ? p[j] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; j++) {
        p[j] = expf(p[j] - m);
        sum += p[j];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t j = 0; j < n; j++) p[j] *= inv;
}

/* o[0..D) = sum_j p[j] * rows[j][0..D) */
static void weighted_sum(float *restrict o, const float *restrict p, const float *const *rows, int64_t len,
                         int64_t D) {
    int64_t c = 0;
    for (; c + 32 <= D; c += 32) {
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t j = 0; j < len; j++) {
            const float *v = rows[j] + c;
            const float w = p[j];
            a0 += w * load8(v);
            a1 += w * load8(v + 8);
            a2 += w * load8(v + 16);
            a3 += w * load8(v + 24);
        }
        store8(o + c, a0);
        store8(o + c + 8, a1);
        store8(o + c + 16, a2);
        store8(o + c + 24, a3);
    }
    for (; c < D; c++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < len; j++) acc += p[j] * rows[j][c];
        o[c] = acc;
    }
}

/* Returns 0, or -1 if scratch memory could not be allocated. */
int kvpush_paged_decode(const float *q, const float *kv, const int64_t *table, const int64_t *lens, float *out,
                        int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t num_layers, int64_t block_size,
                        int64_t nb, int64_t layer, float scale) {
    const int64_t G = H / KVH;                                /* query heads per KV head */
    const int64_t row = KVH * D;                              /* floats per token row of one K or V */
    const int64_t block = num_layers * 2 * block_size * row;  /* floats per block */
    const int64_t layer_off = layer * 2 * block_size * row;
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    float *p = malloc(sizeof(float) * (size_t)max_len);  /* one head's scores, then its weights */
    const float **krows = malloc(sizeof(float *) * (size_t)max_len);  /* this head's K row of each token */
    const float **vrows = malloc(sizeof(float *) * (size_t)max_len);
    const int rc = p && krows && vrows ? 0 : -1;
    for (int64_t b = 0; b < B && rc == 0; b++) {
        const int64_t len = lens[b];
        const int64_t *blocks = table + b * nb;
        for (int64_t h = 0; h < H; h++) {
            const int64_t head = (h / G) * D;
            if (h % G == 0)
                for (int64_t j = 0; j < len; j++) {
                    krows[j] = kv + blocks[j / block_size] * block + layer_off + (j % block_size) * row + head;
                    vrows[j] = krows[j] + block_size * row;
                }
            const float *qh = q + (b * H + h) * D;
            scores(p, qh, krows, len, D, scale);
            softmax(p, len);
            weighted_sum(out + (b * H + h) * D, p, vrows, len, D);
        }
    }
    free(p);
    free(krows);
    free(vrows);
    return rc;
}

/* The new tokens' K and V rows into the cache: row i of k to cache row rows[i] + layer_rows, row i of v
   to rows[T + i] + layer_rows, in the cache's [N * L * 2 * bs] rows of row_bytes each (KVCache.slot_rows).
   Each token's row of k and v is contiguous; consecutive tokens are k_stride / v_stride bytes apart. */
void kvpush_write_rows(char *kv, const int64_t *rows, const char *k, const char *v, int64_t T, int64_t row_bytes,
                       int64_t k_stride, int64_t v_stride, int64_t layer_rows) {
    for (int64_t i = 0; i < T; i++) {
        memcpy(kv + (rows[i] + layer_rows) * row_bytes, k + i * k_stride, (size_t)row_bytes);
        memcpy(kv + (rows[T + i] + layer_rows) * row_bytes, v + i * v_stride, (size_t)row_bytes);
    }
}
