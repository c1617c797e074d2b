/* RoPE on a ubatch's Q and K rows, in place, then K and V rows stored into the layer's cache:
 * what kvtool/models/rope.py's apply_rope and kernels/store_kv.py's store_kv_ref do op by op
 * (they are the specification), in one call with no temporaries.
 *
 * A rotated pair (a, b) with angle table (c, s) becomes (a c - b s, a s + b c), each product
 * rounded to float and then summed: the float32 pair formula's bits, so fused multiply-adds
 * are kept out of this file. NORM pairs dims (2i, 2i + 1), NEOX pairs (i, i + n_rot / 2); dims
 * past n_rot pass through. The cache takes float32, float16 or bfloat16 rows, converted with
 * round-to-nearest-even as torch's .to() converts. */

#if defined(__clang__)
#pragma clang fp contract(off)
#define KEEP_ROUNDING
#elif defined(__GNUC__)
/* GCC's vectorizer turns the pair formula into fused multiply-add-subtracts even with contraction
 * off: the rotation stays scalar (a few hundred pairs a token and layer). */
#define KEEP_ROUNDING __attribute__((optimize("fp-contract=off", "no-tree-vectorize")))
#else
#define KEEP_ROUNDING
#endif

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_half.h"
#include "cpu_kernels.h"

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

/* Rotate n_head heads of one row (heads `hs` floats apart) by the pairs' (cos, sin) in cs. */
KEEP_ROUNDING static void rope_row(float *x, int64_t n_head, int64_t hs, const float *cs, int64_t n_rot, int neox) {
    const int64_t half = n_rot / 2;
    for (int64_t h = 0; h < n_head; h++) {
        float *xh = x + h * hs;
        for (int64_t i = 0; i < half; i++) {
            const int64_t ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
            const float a = xh[ia], b = xh[ib], c = cs[2 * i], s = cs[2 * i + 1];
            const float ac = a * c, bs = b * s, as = a * s, bc = b * c;
            xh[ia] = ac - bs;
            xh[ib] = as + bc;
        }
    }
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return 0x7FC0; /* NaN */
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* Row `src` of `width` floats into cache row `dst` of type `type`. */
static void store_row(uint8_t *dst, const float *src, int64_t width, int type) {
    switch (type) {
    case KV_F16:
        for (int64_t j = 0; j < width; j++) {
            const uint16_t h = float_to_half(src[j]);
            memcpy(dst + 2 * j, &h, 2);
        }
        break;
    case KV_BF16:
        for (int64_t j = 0; j < width; j++) {
            const uint16_t h = float_to_bf16(src[j]);
            memcpy(dst + 2 * j, &h, 2);
        }
        break;
    default: memcpy(dst, src, sizeof(float) * (size_t)width);
    }
}

/* For each of the n ubatch rows r: q row (n_head heads of hd, `ldq` floats apart) and k row
 * (n_head_kv heads) rotated in place by cs[r] ([n_rot / 2] (cos, sin) pairs, rows `ldcs` floats
 * apart; cs NULL: no rotation), then the k row and the v row (width_v floats) stored at cache
 * row rows[r] of k_cache / v_cache (rows `ld_kc` / `ld_vc` elements apart, of `type`). Returns
 * 0, or -1 for a bad call. */
int kvr_rope_store(float *q, int64_t ldq, int64_t n_head, float *k, int64_t ldk, int64_t n_head_kv, int64_t hd,
                   const float *v, int64_t ldv, int64_t width_v, int64_t n, const float *cs, int64_t ldcs,
                   int64_t n_rot, int neox, void *k_cache, int64_t ld_kc, void *v_cache, int64_t ld_vc, int type,
                   const int64_t *rows) {
    if (type < KV_F32 || type > KV_BF16 || n < 0 || n_rot < 0 || n_rot % 2 || n_rot > hd) return -1;
    const int es = type == KV_F32 ? 4 : 2;
    for (int64_t r = 0; r < n; r++) {
        float *kr = k + r * ldk;
        if (cs) {
            rope_row(q + r * ldq, n_head, hd, cs + r * ldcs, n_rot, neox);
            rope_row(kr, n_head_kv, hd, cs + r * ldcs, n_rot, neox);
        }
        store_row((uint8_t *)k_cache + rows[r] * ld_kc * es, kr, n_head_kv * hd, type);
        store_row((uint8_t *)v_cache + rows[r] * ld_vc * es, v + r * ldv, width_v, type);
    }
    return 0;
}
