/* Decode attention read in place from kvpush's block-major paged KV cache (fp32, one thread).

   kv:    [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]  (K at index 0, V at 1)
   q:     [B, H, D]        one query token per sequence, contiguous
   table: [B, nb]          each sequence's block ids (padding past its length is never read)
   lens:  [B]              context length per sequence, the query's own token included
   out:   [B, H, D]

   Query head h attends with KV head h / (H / KVH), as torch's scaled_dot_product_attention with
   enable_gqa. Per sequence, one pass over its context's K rows (each token's row of every KV head read
   once, in cache order, a few rows prefetched ahead) scores every query head; a softmax per head; then
   one pass over the V rows accumulates every head's output. Vectors are 512-bit where the CPU has
   AVX-512, else 256-bit. A decode step is bound by memory here, not arithmetic: the rows come from
   beyond L2, and reading them once, in order, is what counts.
   `python benchmarks/decode_kernel.py --against 6ce5721 --repeats 60` (the previous version: a pass
   over the context per KV head, 256-bit; 6 heads over 3 of 64, block 16; Intel fam 6 model 167,
   2026-12-07): new / old 0.95 [0.92, 0.96] at 16 sequences x 96 tokens, 0.89 [0.86, 0.91] at 16 x 500,
   0.91 [0.89, 0.92] at 64 x 200, cannot tell at one sequence of 100 (0.97 [0.90, 1.06]). Grouping the
   query heads of a KV head over that version's layout instead measured no better (1.04 at 16 x 96).
   Head sizes that are a multiple of 8 but not of 16 take 256-bit vectors there; sizes that are not a
   multiple of 8, plain loops.
   Built by layers/cpu_kernels.py. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"


#if W == 16 /* 256-bit vectors too, for head sizes that are a multiple of 8 but not of 16 */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef int i8 __attribute__((vector_size(32)));
static inline v8 load8(const float *p) { return *(const v8u *)p; }
static inline void store8(float *p, v8 v) { *(v8u *)p = v; }
static inline float hsum8(v8 v) {
    v += __builtin_shuffle(v, (i8){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (i8){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (i8){1, 0, 3, 2, 5, 4, 7, 6});
    return v[0];
}
#endif

static inline float hsum(vf v) {
#if W == 16
    v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#else
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6});
#endif
    return v[0];
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

/* a . b over n floats (vectors where n is a multiple of W, or of 8) */
static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    if (n % W == 0) {
        vf acc0 = {0}, acc1 = {0};
        int64_t d = 0;
        for (; d + 2 * W <= n; d += 2 * W) {
            acc0 += loadv(a + d) * loadv(b + d);
            acc1 += loadv(a + d + W) * loadv(b + d + W);
        }
        if (d < n) acc0 += loadv(a + d) * loadv(b + d);
        return hsum(acc0 + acc1);
    }
#if W == 16
    if (n % 8 == 0) {
        v8 acc = {0};
        for (int64_t d = 0; d < n; d += 8) acc += load8(a + d) * load8(b + d);
        return hsum8(acc);
    }
#endif
    float acc = 0.0f;
    for (int64_t d = 0; d < n; d++) acc += a[d] * b[d];
    return acc;
}

/* o[0..n) += w * x[0..n) */
static inline void axpy(float *restrict o, float w, const float *restrict x, int64_t n) {
    if (n % W == 0) {
        for (int64_t d = 0; d < n; d += W) storev(o + d, loadv(o + d) + w * loadv(x + d));
        return;
    }
#if W == 16
    if (n % 8 == 0) {
        for (int64_t d = 0; d < n; d += 8) store8(o + d, load8(o + d) + w * load8(x + d));
        return;
    }
#endif
    for (int64_t d = 0; d < n; d++) o[d] += w * x[d];
}

#define AHEAD 16 /* rows prefetched ahead */

static inline void prefetch_row(const float *r, int64_t floats) {
    for (int64_t f = 0; f < floats; f += 16) __builtin_prefetch(r + f, 0, 3);
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
    float *p = malloc(sizeof(float) * (size_t)(max_len * H));  /* every head's scores, then its weights */
    const float **krows = malloc(sizeof(float *) * (size_t)(max_len + AHEAD));  /* token j's K row, all heads */
    const int rc = p && krows ? 0 : -1;
    for (int64_t b = 0; b < B && rc == 0; b++) {
        const int64_t len = lens[b], *blocks = table + b * nb;
        const float *qb = q + b * H * D;
        float *ob = out + b * H * D;
        for (int64_t i = 0; i < H * D; i++) ob[i] = 0.0f;
        if (len < 1) continue; /* never from the engine: the query's own token is in its context */
        for (int64_t j = 0; j < len; j++)
            krows[j] = kv + blocks[j / block_size] * block + layer_off + (j % block_size) * row;
        for (int64_t j = len; j < len + AHEAD; j++) krows[j] = krows[len - 1];
        for (int64_t j = 0; j < len; j++) {
            prefetch_row(krows[j + AHEAD], row);
            for (int64_t h = 0; h < H; h++) p[h * max_len + j] = dot(qb + h * D, krows[j] + (h / G) * D, D) * scale;
        }
        for (int64_t h = 0; h < H; h++) softmax(p + h * max_len, len);
        const int64_t v_off = block_size * row;
        for (int64_t j = 0; j < len; j++) {
            prefetch_row(krows[j + AHEAD] + v_off, row);
            for (int64_t h = 0; h < H; h++) axpy(ob + h * D, p[h * max_len + j], krows[j] + v_off + (h / G) * D, D);
        }
    }
    free(p);
    free(krows);
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

/* One decode step of one layer where every row of the batch is a decode row: its K and V rows into the cache
   (kvpush_write_rows), then its attention (kvpush_paged_decode). One call instead of two saves a Python
   round trip per layer. Returns what kvpush_paged_decode returns. */
int kvpush_write_decode(float *kv, const int64_t *rows, const char *k, const char *v, int64_t k_stride,
                        int64_t v_stride, const float *q, const int64_t *table, const int64_t *lens, float *out,
                        int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t num_layers, int64_t block_size,
                        int64_t nb, int64_t layer, float scale) {
    kvpush_write_rows((char *)kv, rows, k, v, B, KVH * D * (int64_t)sizeof(float), k_stride, v_stride,
                      layer * 2 * block_size);
    return kvpush_paged_decode(q, kv, table, lens, out, B, H, KVH, D, num_layers, block_size, nb, layer, scale);
}
