/* RoPE on a ubatch's Q and K rows, in place, then K and V rows stored into the layer's cache:
 * what kvtool/models/rope.py's apply_rope, kernels/hadamard.py's fwht (where the cache asks for
 * llama.cpp's rotation) and kernels/store_kv.py's store_kv_ref do op by op (they are the
 * specification), in one call.
 *
 * A rotated pair (a, b) with angle table (c, s) becomes (a c - b s, a s + b c), each product
 * rounded to float and then summed: the float32 pair formula's bits, so fused multiply-adds
 * are kept out of this file. NORM pairs dims (2i, 2i + 1), NEOX pairs (i, i + n_rot / 2); dims
 * past n_rot pass through. The caches take rows of any K/V type (kv_quant_cpu.c's
 * kvb_quantize_row: float types rounded to nearest even as torch's .to(), quantized ones as
 * ggml's reference quantizers). */

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
#include <stdlib.h>
#include <string.h>

#include "cpu_half.h"
#include "cpu_kernels.h"
#include "kv_blocks.h"

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

/* For each of the n ubatch rows r: q row (n_head heads of hd, `ldq` floats apart) and k row
 * (n_head_kv heads) rotated in place by cs[r] ([n_rot / 2] (cos, sin) pairs, rows `ldcs` floats
 * apart; cs NULL: no rotation), the q row times q_scale (1: not; Gemma's ggml_scale of Qcur after
 * RoPE, before attention rotates and, over a quantized K, quantizes it), then, where rot_k > 0,
 * both turned by llama.cpp's Hadamard rotation of that size (kv_blocks.h's kvb_fwht), and the k
 * row and the v row (width_v floats; turned by a Hadamard rotation of rot_v where rot_v > 0,
 * outside the caller's row) stored at cache row rows[r] of k_cache / v_cache (rows `ld_kc` /
 * `ld_vc` elements of each tensor apart, K of `k_type`, V of `v_type`: kv_blocks.h's ids).
 * Returns 0, or -1 for a bad call. */
int kvr_rope_store(float *q, int64_t ldq, int64_t n_head, float *k, int64_t ldk, int64_t n_head_kv, int64_t hd,
                   const float *v, int64_t ldv, int64_t width_v, int64_t n, const float *cs, int64_t ldcs,
                   int64_t n_rot, int neox, float q_scale, void *k_cache, int64_t ld_kc, void *v_cache, int64_t ld_vc,
                   int k_type, int v_type, int64_t rot_k, int64_t rot_v, const int64_t *rows) {
    if (!kv_valid(k_type) || !kv_valid(v_type) || n < 0 || n_rot < 0 || n_rot % 2 || n_rot > hd) return -1;
    if ((kv_quantized(k_type) && hd % KV_QK) || (kv_quantized(v_type) && width_v % KV_QK)) return -1;
    if ((rot_k && (rot_k & (rot_k - 1) || hd % rot_k)) || (rot_v && (rot_v & (rot_v - 1) || width_v % rot_v))) return -1;
    const int64_t ek = k_type == KV_F32 ? 4 : kv_quantized(k_type) ? 1 : 2;
    const int64_t ev = v_type == KV_F32 ? 4 : kv_quantized(v_type) ? 1 : 2;
    float *vt = rot_v ? malloc(sizeof(float) * (size_t)(width_v > 0 ? width_v : 1)) : NULL;
    if (rot_v && !vt) return -1;
    for (int64_t r = 0; r < n; r++) {
        float *kr = k + r * ldk;
        if (cs) {
            rope_row(q + r * ldq, n_head, hd, cs + r * ldcs, n_rot, neox);
            rope_row(kr, n_head_kv, hd, cs + r * ldcs, n_rot, neox);
        }
        if (q_scale != 1.0f)
            for (int64_t j = 0; j < n_head * hd; j++) q[r * ldq + j] *= q_scale;
        if (rot_k) {
            kvb_fwht(q + r * ldq, n_head * hd, rot_k);
            kvb_fwht(kr, n_head_kv * hd, rot_k);
        }
        const float *vr = v + r * ldv;
        if (rot_v) {
            memcpy(vt, vr, sizeof(float) * (size_t)width_v);
            kvb_fwht(vt, width_v, rot_v);
            vr = vt;
        }
        kvb_quantize_row(k_type, kr, n_head_kv * hd, (uint8_t *)k_cache + rows[r] * ld_kc * ek);
        kvb_quantize_row(v_type, vr, width_v, (uint8_t *)v_cache + rows[r] * ld_vc * ev);
    }
    free(vt);
    return 0;
}
