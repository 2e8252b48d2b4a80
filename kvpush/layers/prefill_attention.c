/* Causal attention of a prefill chunk (fp32, one thread): every query row of the chunk against the keys up
   to its own position, in place of torch's SDPA (layers/attention.py's other path).

   q:   [T, H, D]     the chunk's queries; token t at q + t * q_stride, its heads contiguous
   k,v: [ctx, KVH, D] every key and value of the context, the chunk's own last; token j at k + j * k_stride
   out: [T, H, D]     contiguous
   Query row t sits at position offset + t (offset = ctx - T) and sees keys 0 .. offset + t.

   Query head h attends with KV head h / (H / KVH). Per KV head, the keys go in chunks of CH (512): each
   chunk's keys are transposed into kt [CH / KC, D, KC] (zeros past the context), small enough to stay in
   L2 while every query block that sees the chunk reads it. A query block is up to MB query vectors (row,
   head), rows ascending; against a chunk it takes the scores of the keys its last row sees, KC keys at a
   time (each kt load serves MB queries), exp of each score minus the query's running max (over every
   chunk so far), and the weighted sum of the value rows (each loaded once for the block); the query's
   running sum and output are rescaled when its max grows (the online softmax of flash attention). Scores
   of a block: MB x CH floats. The output is divided by the sums at the end.
   Needs D a multiple of the vector width (kvpush_prefill_width(): 16 floats with AVX-512, else 8);
   returns -2 otherwise. Built by layers/cpu_kernels.py. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

#ifndef MB
#define MB 6 /* query vectors a block */
#endif
#ifndef KV
#define KV 2 /* vectors of keys scored at once */
#endif
#define KC (KV * W) /* keys scored at once */
#ifndef CH
#define CH 512 /* keys a chunk (a multiple of KC): D x CH transposed keys, 128 KiB at D = 64 */
#endif
_Static_assert(CH % KC == 0, "CH must be a multiple of KC: kt and the scores hold CH keys a chunk");
#define DC 4 /* value vectors summed at once */


/* s[m][j .. j + KC) = qb[m] . keys j .. j + KC for m < M, every j < n (a multiple of KC); kt: the keys
   transposed in chunks of KC, [n / KC, D, KC] */
static inline __attribute__((always_inline)) void scores(const float *restrict qb, const float *restrict kt,
                                                          float *restrict s, int64_t n, int64_t D, const int M) {
    for (int64_t j = 0; j < n; j += KC) {
        const float *kc = kt + j * D;
        vf a[MB][KV];
        for (int m = 0; m < M; m++)
            for (int c = 0; c < KV; c++) a[m][c] = (vf){0};
        for (int64_t d = 0; d < D; d++) {
            vf k[KV];
            for (int c = 0; c < KV; c++) k[c] = loadv(kc + d * KC + c * W);
            for (int m = 0; m < M; m++) {
                const vf x = splat(qb[m * D + d]);
                for (int c = 0; c < KV; c++) a[m][c] += x * k[c];
            }
        }
        for (int m = 0; m < M; m++)
            for (int c = 0; c < KV; c++) storev(s + m * n + j + c * W, a[m][c]);
    }
}

/* o[m] (D floats) = sum over j < n of s[m][j] * v row j, for m < M */
static inline __attribute__((always_inline)) void weighted(const float *restrict s, int64_t ld,
                                                            const float *restrict v, int64_t v_stride,
                                                            float *restrict o, int64_t n, int64_t D, const int M) {
    for (int64_t d0 = 0; d0 < D; d0 += DC * W) {
        const int nc = (int)((D - d0) / W < DC ? (D - d0) / W : DC);
        vf acc[MB][DC];
        for (int m = 0; m < M; m++)
            for (int c = 0; c < DC; c++) acc[m][c] = (vf){0};
        for (int64_t j = 0; j < n; j++) {
            const float *vr = v + j * v_stride + d0;
            vf x[DC];
            for (int c = 0; c < DC; c++) x[c] = c < nc ? loadv(vr + c * W) : (vf){0};
            for (int m = 0; m < M; m++) {
                const vf p = splat(s[m * ld + j]);
                for (int c = 0; c < DC; c++) acc[m][c] += p * x[c];
            }
        }
        for (int m = 0; m < M; m++)
            for (int c = 0; c < nc; c++) storev(o + m * D + d0 + c * W, acc[m][c]);
    }
}

/* One block of M query vectors against keys [0, n) of the current chunk (n = the most any of them sees):
   seen[m] keys for query m. Updates each query's running max mx[m], sum l[m] and output row o[m] (D floats,
   weighted by exp(score - mx[m])) with the chunk's keys. */
static void block(const float *qb, const int64_t *seen, int M, const float *kt, const float *v, int64_t v_stride,
                  float *s, float *part, float *const *o, float *mx, float *l, int64_t D) {
    int64_t n = 0;
    for (int m = 0; m < M; m++) n = seen[m] > n ? seen[m] : n;
    const int64_t np = (n + KC - 1) / KC * KC;
    if (M == MB) /* a constant M: the accumulators stay in registers (the last block may be shorter) */
        scores(qb, kt, s, np, D, MB);
    else
        scores(qb, kt, s, np, D, M);
    float corr[MB];
    for (int m = 0; m < M; m++) {
        const float before = mx[m];
        const float sum = exp_row(s + m * np, seen[m], np, &mx[m]);
        corr[m] = expf(before - mx[m]);
        l[m] = l[m] * corr[m] + sum;
    }
    if (M == MB)
        weighted(s, np, v, v_stride, part, n, D, MB);
    else
        weighted(s, np, v, v_stride, part, n, D, M);
    for (int m = 0; m < M; m++)
        for (int64_t d = 0; d < D; d++) o[m][d] = o[m][d] * corr[m] + part[m * D + d];
}

/* The vector width in floats: D must be a multiple of it. */
int kvpush_prefill_width(void) { return W; }

/* Returns 0; -1 if scratch memory could not be allocated, -2 if D is not a multiple of the vector width
   (nothing written then). Strides are in floats. */
int kvpush_prefill_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                             int64_t v_stride, float *out, int64_t T, int64_t ctx, int64_t H, int64_t KVH,
                             int64_t D, float scale) {
    if (D % W != 0 || T < 1 || ctx < T || KVH < 1 || H % KVH != 0) return -2;
    const int64_t G = H / KVH, offset = ctx - T;
    float *kt = malloc(sizeof(float) * (size_t)(D * CH)), *s = malloc(sizeof(float) * (size_t)(MB * CH));
    float *qb = malloc(sizeof(float) * (size_t)(MB * D)), *part = malloc(sizeof(float) * (size_t)(MB * D));
    float *mx = malloc(sizeof(float) * (size_t)(T * H)), *l = malloc(sizeof(float) * (size_t)(T * H));
    const int rc = kt && s && qb && part && mx && l ? 0 : -1;
    for (int64_t i = 0; i < T * H && rc == 0; i++) mx[i] = -1e30f, l[i] = 0.0f; /* no inf under -ffast-math */
    if (rc == 0) memset(out, 0, sizeof(float) * (size_t)(T * H * D));
    for (int64_t g = 0; g < KVH && rc == 0; g++) {
        for (int64_t c0 = 0; c0 < ctx; c0 += CH) { /* key chunks: their transposed keys stay in L2 */
            const int64_t width = ctx - c0 < CH ? ctx - c0 : CH, padded = (width + KC - 1) / KC * KC;
            for (int64_t j = 0; j < padded; j++) /* kt: [padded / KC, D, KC], zeros past the chunk */
                for (int64_t d = 0; d < D; d++)
                    kt[(j / KC) * D * KC + d * KC + j % KC] = j < width ? k[(c0 + j) * k_stride + g * D + d] : 0.0f;
            const float *vc = v + c0 * v_stride + g * D;
            const int64_t t0 = c0 > offset ? c0 - offset : 0; /* the first query row that sees key c0 */
            for (int64_t i = t0 * G; i < T * G; i += MB) { /* query vectors (t, h) of this KV head, t-major */
                const int M = (int)(T * G - i < MB ? T * G - i : MB);
                int64_t seen[MB], at[MB];
                float *o[MB];
                for (int m = 0; m < M; m++) {
                    const int64_t t = (i + m) / G, h = g * G + (i + m) % G, sees = offset + t + 1 - c0;
                    seen[m] = sees < width ? sees : width;
                    at[m] = t * H + h;
                    o[m] = out + at[m] * D;
                    for (int64_t d = 0; d < D; d++) qb[m * D + d] = q[t * q_stride + h * D + d] * scale;
                }
                float bmx[MB], bl[MB];
                for (int m = 0; m < M; m++) bmx[m] = mx[at[m]], bl[m] = l[at[m]];
                block(qb, seen, M, kt, vc, v_stride, s, part, o, bmx, bl, D);
                for (int m = 0; m < M; m++) mx[at[m]] = bmx[m], l[at[m]] = bl[m];
            }
        }
    }
    for (int64_t i = 0; i < T * H && rc == 0; i++)
        for (int64_t d = 0; d < D; d++) out[i * D + d] /= l[i];
    free(kt);
    free(s);
    free(qb);
    free(part);
    free(mx);
    free(l);
    return rc;
}
