/* Vector types the CPU kernels share (paged_decode.c, prefill_attention.c): W floats a vector, 512-bit
   where the CPU has AVX-512, else 256-bit, and unaligned loads and stores. Built by layers/cpu_kernels.py. */
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

#endif
