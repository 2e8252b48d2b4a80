/* Decode attention read in place from kvpush's block-major paged KV cache (fp32, one thread).

   kv:    [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]  (K at index 0, V at 1)
   q:     [B, H, D]        one query token per sequence, contiguous
   table: [B, nb]          each sequence's block ids (padding past its length is never read)
   lens:  [B]              context length per sequence, the query's own token included
   out:   [B, H, D]

   Query head h attends with KV head h / (H / KVH), as torch's scaled_dot_product_attention with
   enable_gqa. Per sequence: the scores of every query head, a softmax per head, then the weighted sum of
   the V rows. Where the CPU has AVX-512 and the head size is a multiple of 16 floats up to 128 (attend16):
   one pass over the context's K rows (each token's row of every KV head read once, in cache order, a few
   rows prefetched ahead) keeps each head's products of a token as a vector, and a tile of 16 tokens is
   summed across lanes at once (hsum16); exp over the tiles is vectorised and the sums divide the outputs
   at the end; then per KV head, in spans of 128 tokens, up to 16 / (D / 16) of its query heads at a
   time accumulate their outputs in registers over the span's V rows (a span read once from memory, again
   from L2 for each further group of query heads). Other head sizes and 256-bit CPUs take attend_plain: per token a dot
   product and horizontal sum per head, per token an update of every head's output row in memory.
   A decode step is bound by memory here, not arithmetic, once the rows come from beyond L2.
   `python benchmarks/decode_kernel.py --against 3024a3e --repeats 60` (6 heads over 3 of 64, block 16, rows
   from beyond L2; Intel fam 6 model 167, 2026-12-08): this kernel / 3024a3e's (attend_plain's loops) 0.944
   [0.925, 0.969] at 16 sequences x 96 tokens, 0.896 [0.880, 0.915] at 16 x 500, 0.937 [0.925, 0.954] at 64 x
   200, cannot tell at one sequence of 100; `--heads 32,4,128` (Llama-3-8B's: four register groups of 2 query
   heads a KV head) 0.835-0.935, better at every shape.
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

/* One sequence, any head size: per token, every query head's score (a dot product and its horizontal sum);
   a softmax per head; per token, every head's output row += weight * V row (outputs in memory). */
static void attend_plain(const float *qb, const float **krows, int64_t len, int64_t H, int64_t KVH, int64_t D,
                         int64_t v_off, float scale, float *p, int64_t ps, float *ob) {
    const int64_t G = H / KVH, row = KVH * D;
    for (int64_t i = 0; i < H * D; i++) ob[i] = 0.0f;
    for (int64_t j = 0; j < len; j++) {
        prefetch_row(krows[j + AHEAD], row);
        for (int64_t g = 0, h = 0; g < KVH; g++)  /* query head h = g * G + i uses KV head g */
            for (int64_t i = 0; i < G; i++, h++) p[h * ps + j] = dot(qb + h * D, krows[j] + g * D, D) * scale;
    }
    for (int64_t h = 0; h < H; h++) softmax(p + h * ps, len);
    for (int64_t j = 0; j < len; j++) {
        prefetch_row(krows[j + AHEAD] + v_off, row);
        for (int64_t g = 0, h = 0; g < KVH; g++)
            for (int64_t i = 0; i < G; i++, h++) axpy(ob + h * D, p[h * ps + j], krows[j] + v_off + g * D, D);
    }
}

#if W == 16
#include <immintrin.h>
#define TILE 16 /* tokens scored at once */

/* The horizontal sums of a[0 .. 16): lane t of the result is the sum of a[t]'s lanes. Four rounds fold pairs of
   vectors into one (15 adds and 30 shuffles for the 16 sums, where one sum alone takes 4 of each); the last
   round leaves the sums in the order PERM undoes. */
static inline vf hsum16(const vf *a) {
    __m512 b[8], c[4], d[2];
    for (int k = 0; k < 8; k++) {  /* b[k]: 8 partial sums of a[k], then 8 of a[k + 8] */
        const __m512 x = (__m512)a[k], y = (__m512)a[k + 8];
        b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
    for (int k = 0; k < 4; k++)  /* c[k]: 4 partials of a[k], a[k + 8], a[k + 4], a[k + 12] */
        c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[k], b[k + 4], 0x88), _mm512_shuffle_f32x4(b[k], b[k + 4], 0xDD));
    for (int k = 0; k < 2; k++)  /* d[k]: per 128-bit lane, 2 partials of c[k]'s vector, 2 of c[k + 2]'s */
        d[k] = _mm512_add_ps(_mm512_shuffle_ps(c[k], c[k + 2], 0x44), _mm512_shuffle_ps(c[k], c[k + 2], 0xEE));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
    const __m512i perm = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
    return (vf)_mm512_permutexvar_ps(perm, e);
}

/* p[h * ps + j] = scale * q_h . K_j for every head h and token j < len (D = DW vectors), TILE tokens at a time:
   per token each head's products stay a vector (in S, [H][TILE]) and hsum16 sums a tile's at once. Past len, up
   to the tile's end, p gets zeros (ps: a multiple of TILE). */
static inline __attribute__((always_inline)) void scores16(const float *qb, const float **krows, int64_t len,
                                                           int64_t H, int64_t KVH, const int DW, float scale,
                                                           vf *S, float *p, int64_t ps) {
    const int64_t D = DW * W, G = H / KVH;
    for (int64_t j0 = 0; j0 < len; j0 += TILE) {
        const int64_t n = len - j0 < TILE ? len - j0 : TILE;
        for (int64_t t = 0; t < n; t++) {
            prefetch_row(krows[j0 + t + AHEAD], KVH * D);
            for (int64_t g = 0, h = 0; g < KVH; g++) {
                vf k[8];
                for (int c = 0; c < DW; c++) k[c] = loadv(krows[j0 + t] + g * D + c * W);
                for (int64_t i = 0; i < G; i++, h++) {
                    vf acc = loadv(qb + h * D) * k[0];
                    for (int c = 1; c < DW; c++) acc += loadv(qb + h * D + c * W) * k[c];
                    S[h * TILE + t] = acc;
                }
            }
        }
        for (int64_t h = 0; h < H; h++) {
            for (int64_t t = n; t < TILE; t++) S[h * TILE + t] = (vf){0};
            storev(p + h * ps + j0, hsum16(S + h * TILE) * scale);
        }
    }
}

/* ob[h] = inv[h] * the sum over tokens j < len of p[h * ps + j] * V_j (KV head h / G): per KV head, the context
   in spans of VSPAN tokens (one KV head's V rows of a span stay in L2), and within a span up to 16 / DW of
   its query heads at a time, their output rows in registers across the span's tokens (carried in ob
   between spans). Where a KV head has more query heads than that, each span's V rows are read once per
   group of them, from L2, not once per group over the whole context. */
#define VSPAN 128
static inline __attribute__((always_inline)) void values16(const float *p, int64_t ps, const float **krows,
                                                           int64_t len, int64_t H, int64_t KVH, const int DW,
                                                           int64_t v_off, const float *inv, float *ob) {
    enum { GB = 16 };  /* bound on heads at a time; the loops below stop at gb <= 16 / DW */
    const int64_t D = DW * W, G = H / KVH, gb_max = 16 / DW;
    for (int64_t g = 0; g < KVH; g++)
        for (int64_t j0 = 0; j0 < len; j0 += VSPAN) {
            const int64_t j1 = len - j0 < VSPAN ? len : j0 + VSPAN;
            for (int64_t h0 = g * G; h0 < (g + 1) * G; h0 += gb_max) {
                const int64_t gb = (g + 1) * G - h0 < gb_max ? (g + 1) * G - h0 : gb_max;
                vf acc[GB][8];
                for (int i = 0; i < 16 / DW; i++)
                    for (int c = 0; c < DW; c++) acc[i][c] = j0 > 0 && i < gb ? loadv(ob + (h0 + i) * D + c * W) : (vf){0};
                for (int64_t j = j0; j < j1; j++) {
                    const float *v = krows[j] + v_off + g * D;
                    prefetch_row(krows[j + AHEAD] + v_off + g * D, D);
                    vf x[8];
                    for (int c = 0; c < DW; c++) x[c] = loadv(v + c * W);
                    for (int i = 0; i < 16 / DW; i++) {
                        if (i >= gb) break;
                        const vf w = (vf){0} + p[(h0 + i) * ps + j];
                        for (int c = 0; c < DW; c++) acc[i][c] += w * x[c];
                    }
                }
                const int last = j1 == len;  /* the outputs are complete: divide by the sums */
                for (int i = 0; i < gb; i++)
                    for (int c = 0; c < DW; c++)
                        storev(ob + (h0 + i) * D + c * W, last ? acc[i][c] * inv[h0 + i] : acc[i][c]);
            }
        }
}

/* One sequence, head size DW vectors (1 to 8): scores16, exp_row per head, values16 (which divides by the
   sums). */
static inline __attribute__((always_inline)) void attend16(const float *qb, const float **krows, int64_t len,
                                                           int64_t H, int64_t KVH, const int DW, int64_t v_off,
                                                           float scale, vf *S, float *p, int64_t ps, float *ob) {
    float inv[H];
    scores16(qb, krows, len, H, KVH, DW, scale, S, p, ps);
    for (int64_t h = 0; h < H; h++) {  /* exp over whole tiles (cpu_vec.h's exp_row), zeros past len */
        float max = -3.0e38f;
        inv[h] = 1.0f / exp_row(p + h * ps, len, (len + TILE - 1) / TILE * TILE, &max);
    }
    values16(p, ps, krows, len, H, KVH, DW, v_off, inv, ob);
}

/* attend16 for this head size, or 0 where it has none (a head size not a multiple of 16 floats, or over 128) */
static int attend_vec(const float *qb, const float **krows, int64_t len, int64_t H, int64_t KVH, int64_t D,
                      int64_t v_off, float scale, vf *S, float *p, int64_t ps, float *ob) {
    switch (D % W ? 0 : D / W) {
#define CASE(n) case n: attend16(qb, krows, len, H, KVH, n, v_off, scale, S, p, ps, ob); return 1;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        default: return 0;
    }
}
#endif

/* 1 where kvpush_paged_decode takes heads of D floats by attend16 (this build has AVX-512 and D is a multiple
   of 16 up to 128), 0 where by attend_plain (for tests: the path a head size takes) */
int kvpush_decode_vector_path(int64_t D) {
#if W == 16
    return D % W == 0 && D >= W && D <= 8 * W;
#else
    (void)D;
    return 0;
#endif
}

/* Returns 0, or -1 if scratch memory could not be allocated. */
int kvpush_paged_decode(const float *q, const float *kv, const int64_t *table, const int64_t *lens, float *out,
                        int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t num_layers, int64_t block_size,
                        int64_t nb, int64_t layer, float scale) {
    const int64_t row = KVH * D;                              /* floats per token row of one K or V */
    const int64_t block = num_layers * 2 * block_size * row;  /* floats per block */
    const int64_t layer_off = layer * 2 * block_size * row, v_off = block_size * row;
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    const int64_t ps = (max_len + 15) / 16 * 16;  /* floats a head's scores take: whole tiles */
    float *p = malloc(sizeof(float) * (size_t)(ps * H));  /* every head's scores, then its weights */
    const float **krows = malloc(sizeof(float *) * (size_t)(max_len + AHEAD));  /* token j's K row, all heads */
    vf *S = aligned_alloc(64, sizeof(vf) * (size_t)(16 * H));  /* a tile's products, [H][16] */
    const int rc = p && krows && S ? 0 : -1;
    for (int64_t b = 0; b < B && rc == 0; b++) {
        const int64_t len = lens[b], *blocks = table + b * nb;
        const float *qb = q + b * H * D;
        float *ob = out + b * H * D;
        if (len < 1) {  /* never from the engine: the query's own token is in its context */
            for (int64_t i = 0; i < H * D; i++) ob[i] = 0.0f;
            continue;
        }
        for (int64_t j0 = 0, i = 0; j0 < len; j0 += block_size, i++) {  /* no division per token */
            const float *base = kv + blocks[i] * block + layer_off;
            for (int64_t j = j0; j < j0 + block_size && j < len; j++) krows[j] = base + (j - j0) * row;
        }
        for (int64_t j = len; j < len + AHEAD; j++) krows[j] = krows[len - 1];
#if W == 16
        if (attend_vec(qb, krows, len, H, KVH, D, v_off, scale, S, p, ps, ob)) continue;
#endif
        attend_plain(qb, krows, len, H, KVH, D, v_off, scale, p, ps, ob);
    }
    free(p);
    free(krows);
    free(S);
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
