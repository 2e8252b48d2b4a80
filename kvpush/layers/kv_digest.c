/* The emulated forward's read-back (kvpush/emulate/kv_pattern.py, KVPattern.digests): one pass over a
   context's rows in cache order, reading each row's first and last element, instead of torch's gather,
   widen and multiply over a [positions, layers * 4] copy (230 ms for a 16k context of Qwen3-32B's
   per-rank geometry, more than the decode step it sits in at --time-scale 20).

   Same sum as the torch path, bit for bit: over positions p in [start, end), layers l, K|V kv and ends e
   (first, last element), fold(bits) * ((w_pos[p] ^ w_end[(l * 2 + kv) * 2 + e]) & (2^24 - 1)), modulo 2^64,
   where bits are the element's raw bits sign-extended to 32 and fold(x) = (x ^ (x >> 16)) & 0xFFFF. */
#include <stdint.h>
#include <string.h>

static inline uint64_t fold(const char *p, int64_t elem_size) {
    uint32_t u;
    if (elem_size == 2) {
        int16_t v;
        memcpy(&v, p, 2);
        u = (uint32_t)(int32_t)v;
    } else {
        memcpy(&u, p, 4);
    }
    return (u ^ (u >> 16)) & 0xFFFFu;
}

/* kv: the cache [N, L, 2, bs, row]; table: the span's block table; row_elems elements of elem_size (2 or 4)
   bytes per row; w_pos [>= end], w_end [L * 4]. Returns the sum's 64 bits. */
int64_t kvpush_kv_digest(const char *kv, const int64_t *table, int64_t start, int64_t end, int64_t num_layers,
                         int64_t block_size, int64_t row_elems, int64_t elem_size, const int64_t *w_pos,
                         const int64_t *w_end) {
    const int64_t row_bytes = row_elems * elem_size, last = (row_elems - 1) * elem_size;
    const uint64_t mask = (1u << 24) - 1;
    uint64_t sum = 0;
    for (int64_t p = start; p < end;) {
        const int64_t b = p / block_size, lo = p % block_size;
        const int64_t hi = (end - p < block_size - lo) ? lo + (end - p) : block_size;
        const char *block = kv + table[b] * num_layers * 2 * block_size * row_bytes;
        const int64_t *wp = w_pos + b * block_size;
        for (int64_t r = 0; r < num_layers * 2; r++) { /* r = l * 2 + kv: rows of one layer's K or V */
            const char *rows = block + r * block_size * row_bytes;
            const uint64_t w0 = (uint64_t)w_end[r * 2], w1 = (uint64_t)w_end[r * 2 + 1];
            for (int64_t s = lo; s < hi; s++) {
                const char *row = rows + s * row_bytes;
                const uint64_t w = (uint64_t)wp[s];
                sum += fold(row, elem_size) * ((w ^ w0) & mask) + fold(row + last, elem_size) * ((w ^ w1) & mask);
            }
        }
        p += hi - lo;
    }
    return (int64_t)sum;
}
