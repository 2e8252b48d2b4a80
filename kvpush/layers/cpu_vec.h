/* Vector types and helpers the CPU kernels share (paged_decode.c, prefill_attention.c), exp over score rows
   included: W floats a vector, 512-bit where the CPU has AVX-512, else 256-bit, and unaligned loads and stores. Built by layers/cpu_kernels.py. */
#ifndef KVPUSH_CPU_VEC_H
#define KVPUSH_CPU_VEC_H

#if defined(__AVX512F__)
#define W 16 /* floats a vector */
typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4), may_alias)); /* unaligned access */
typedef int vi __attribute__((vector_size(64)));
#else
#define W 8
typedef float vf __attribute__((vector_size(32)));
typedef float vfu __attribute__((vector_size(32), aligned(4), may_alias));
typedef int vi __attribute__((vector_size(32)));

#endif

static inline vf loadv(const float *p) { return *(const vfu *)p; }
static inline void storev(float *p, vf v) { *(vfu *)p = v; }
static inline vf splat(float x) { return (vf){0} + x; }
static inline vf sel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); } /* m ? a : b, per lane */

/* exp(x) for x <= 0 (a score minus its query's max): 2^i * e^r with x = i ln2 + r, |r| <= ln2 / 2, e^r by its
   degree-6 Taylor polynomial (relative error of a few 1e-7, as libm's expf to a few ulp). x is clamped to
   [-87, 0] first: e^-87 (1.6e-38, still a normal float) stands for anything smaller, and scores past a
   query's last key (masked to 0 by the caller) never reach the float-to-int conversion out of range. */
static inline vf vexp(vf x) {
    const vf lo = splat(-87.0f), hi = splat(0.0f);
    x = sel(x < lo, lo, x);
    x = sel(x > hi, hi, x);
    const vf t = x * 1.44269504f + 0.5f;
    vf fi = __builtin_convertvector(__builtin_convertvector(t, vi), vf);
    fi -= sel(fi > t, splat(1.0f), splat(0.0f)); /* floor(t) = round(x / ln2) */
    const vf r = (x - fi * 0.693145752f) - fi * 1.42860677e-6f;
    vf p = splat(1.0f / 720);
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vi bits = (__builtin_convertvector(fi, vi) + 127) << 23;
    return p * (vf)bits;
}

/* p[0 .. n) = exp(p - max) over its first `seen` entries, 0 past them (n: a multiple of W), where max is the
   larger of *running and those entries' max, written back to *running; returns their sum */
static float exp_row(float *restrict p, int64_t seen, int64_t n, float *running) {
    vf mv = splat(*running);
    int64_t j = 0;
    for (; j + W <= seen; j += W) {
        const vf x = loadv(p + j);
        mv = sel(x > mv, x, mv);
    }
    float mx = mv[0];
    for (int i = 1; i < W; i++) mx = mv[i] > mx ? mv[i] : mx;
    for (; j < seen; j++) mx = p[j] > mx ? p[j] : mx;
    *running = mx;
    vf idx, acc = {0};
    for (int i = 0; i < W; i++) idx[i] = (float)i;
    for (j = 0; j < n; j += W) {
        vf e = vexp(loadv(p + j) - mx);
        e = sel(idx + (float)j < (float)seen, e, splat(0.0f));
        storev(p + j, e);
        acc += e;
    }
    float sum = 0.0f;
    for (int i = 0; i < W; i++) sum += acc[i];
    return sum;
}

#endif
