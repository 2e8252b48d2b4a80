/* Decode attention read in place from kvpush's block-major paged KV cache (fp32, one thread).

   kv:    [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]  (K at index 0, V at 1)
   q:     [B, H, D]        one query token per sequence, contiguous
   table: [B, nb]          each sequence's block ids (padding past its length is never read)
   lens:  [B]              context length per sequence, the query's own token included
   out:   [B, H, D]

   Query head h attends with KV head h / (H / KVH), as torch's scaled_dot_product_attention with
   enable_gqa. Token by token, each K row (all KV heads, contiguous) is read once for every query
   head's score, then a softmax per head, then each V row once for every head's weighted sum: the
   context streams through once for K and once for V, where the gather + SDPA path copies every row
   first and reads it again. The work is bound by memory bandwidth (a batch of 32 x 530 tokens of
   the bench preset reads 26 MB a layer in ~1.7 ms, ~15 GB/s on one core here); reading the rows in
   this order was ~20% faster than group by group, and inlining per head size slower still.
   Built by layers/cpu_kernels.py. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < n; d++) acc += a[d] * b[d];
    return acc;
}

static void axpy(float *restrict y, float a, const float *restrict x, int64_t n) {
#pragma omp simd
    for (int64_t d = 0; d < n; d++) y[d] += a * x[d];
}

/* p[0..n) = exp(p - max); returns their sum */
static float softmax_numerators(float *restrict p, int64_t n) {
    float m = p[0];
    for (int64_t j = 1; j < n; j++) m = p[j] > m ? p[j] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; j++) {
        p[j] = expf(p[j] - m);
        sum += p[j];
    }
    return sum;
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
    float *scores = malloc(sizeof(float) * (size_t)(H * max_len));
    if (!scores) return -1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = lens[b];
        const int64_t *blocks = table + b * nb;
        const float *qb = q + b * H * D;
        float *ob = out + b * H * D;
        for (int64_t j = 0; j < len; j++) {
            const float *k = kv + blocks[j / block_size] * block + layer_off + (j % block_size) * row;
            for (int64_t h = 0; h < H; h++) scores[h * len + j] = dot(qb + h * D, k + (h / G) * D, D) * scale;
        }
        memset(ob, 0, sizeof(float) * (size_t)(H * D));
        float inv[H];
        for (int64_t h = 0; h < H; h++) inv[h] = 1.0f / softmax_numerators(scores + h * len, len);
        for (int64_t j = 0; j < len; j++) {
            const float *v = kv + blocks[j / block_size] * block + layer_off + (block_size + j % block_size) * row;
            for (int64_t h = 0; h < H; h++) axpy(ob + h * D, scores[h * len + j], v + (h / G) * D, D);
        }
        for (int64_t h = 0; h < H; h++)
            for (int64_t d = 0; d < D; d++) ob[h * D + d] *= inv[h];
    }
    free(scores);
    return 0;
}
